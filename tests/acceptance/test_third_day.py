"""A newcomer's third day: CI's script leaves the developer's venv alone, the README's first screen
says what to run and what it gives, and the README's promises about the run's lines hold."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import torch
from cli import ROOT

README = (ROOT / "README.md").read_text()
CI_RUN = (ROOT / ".ci" / "run").read_text()


# --- .ci/run: a venv of CI's own ----------------------------------------------------------------


def _fake(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_ci_run_makes_its_own_venv_and_leaves_the_developers_alone(tmp_path):
    """.ci/run in a copy whose python3, pip, ruff and check_triton.sh only record their calls: the
    developer's .venv is untouched, every command runs from CI's venv (made anew: a stale file in it
    goes), and the venv's folder is one .gitignore keeps out."""
    tree = tmp_path / "tree"
    (tree / ".ci").mkdir(parents=True)
    (tree / ".ci" / "run").write_text(CI_RUN)
    (tree / "scripts").mkdir()
    calls = tmp_path / "calls"
    _fake(tree / "scripts" / "check_triton.sh", f'echo "check_triton $*" >> {calls}\n')
    (tree / ".venv").mkdir()
    (tree / ".venv" / "mine").write_text("the developer's")
    (tree / ".ci" / "venv").mkdir()
    (tree / ".ci" / "venv" / "stale").write_text("an earlier run's")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    # python3 -m venv DIR: a venv whose tools record their arguments (pip's probe of the CPU index fails)
    _fake(tmp_path / "tool", f'echo "$(basename "$0") $*" >> {calls}\n[ "$1 $2" != "--isolated index" ]\n')
    _fake(
        bin_ / "python3",
        f'mkdir -p "$3/bin"; for t in pip ruff python; do cp {tmp_path / "tool"} "$3/bin/$t"; done\n'
        f'echo "python3 $*" >> {calls}\n',
    )
    env = dict(os.environ, PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}")
    env.pop("CI_VENV", None)
    proc = subprocess.run(["bash", ".ci/run"], cwd=tree, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (tree / ".venv" / "mine").read_text() == "the developer's" and not (tree / ".ci" / "venv" / "stale").exists()
    lines = calls.read_text().splitlines()
    assert lines[0] == "python3 -m venv .ci/venv"
    assert "pip install -q -e .[test,lint,dali,triton]" in lines and "python -m pytest -n auto --dist loadfile" in lines
    assert lines[-1] == "check_triton .ci/venv" and "cannot be reached" in proc.stdout
    commands = [ln for ln in CI_RUN.replace(".ci/venv", "").splitlines() if not ln.lstrip().startswith("#")]
    assert not [ln for ln in commands if ".venv" in ln], "CI never names the developer's venv"
    assert "/.ci/venv/" in (ROOT / ".gitignore").read_text().splitlines()


def test_readme_development_gives_what_ci_runs():
    """The README's Development section names CI's install, its linters and its test command."""
    dev = README[README.index("## Development") :]
    ci = re.sub(r'"\$venv/bin/(\w+)"', r"\1", CI_RUN)  # "$venv/bin/ruff" check . -> ruff check .
    install = re.search(r"pip\"? install -q -e '(\.\[[a-z,]+\])'", CI_RUN).group(1)
    assert f"pip install -e '{install}'" in dev
    tests = re.search(r"^python -m pytest.*$", ci, re.M).group(0)  # CI's whole command, its options too
    for command in ("ruff check .", "ruff format --check .", tests):
        assert command in ci and command in dev, command


# --- the README: its length, its first screen, its promises about a run's lines -----------------

FIRST_SCREEN = "\n".join(README.splitlines()[:40])  # what a terminal or a repository page shows first
CPU_RUN = re.search(r"^    (OMP_NUM_THREADS=1 \.venv/bin/fastcifar train .*--device cpu.*)$", FIRST_SCREEN, re.M)


def test_readme_is_at_most_300_lines():
    assert len(README.splitlines()) <= 300, len(README.splitlines())


def test_the_first_screen_has_the_result_and_both_installs_to_a_first_run():
    """What it is, the default's official figure with its conditions (runs, device, date), the GPU
    and the CPU lines from install to a first run, and what the CPU run gives."""
    from fastcifar.core.presets import DEFAULT_PRESET

    assert "trains image classifiers on CIFAR-10" in FIRST_SCREEN
    row = next(ln for ln in FIRST_SCREEN.splitlines() if ln.startswith(f"| `{DEFAULT_PRESET}` (the default) | 25 |"))
    assert "H100" in row and re.search(r"\| 20\d\d-\d\d-\d\d \|$", row), row
    assert "python3 -m venv .venv && .venv/bin/pip install -e '.[dali]'" in FIRST_SCREEN
    assert ".venv/bin/fastcifar train --data data --download" in FIRST_SCREEN
    cpu_install = (
        ".venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu && .venv/bin/pip install -e ."
    )
    assert f"python3 -m venv .venv && {cpu_install}" in FIRST_SCREEN
    assert CPU_RUN is not None and "--data data --download" in CPU_RUN.group(1)
    # what the CPU run gives, in the command's own numbers: images, epochs, an accuracy and a time
    flags = dict(re.findall(r"--(subset|epochs) (\d+)", CPU_RUN.group(1)))
    gives = " ".join(FIRST_SCREEN[FIRST_SCREEN.index(CPU_RUN.group(1)) :].split())
    assert f"{int(flags['subset']):,} training images for {flags['epochs']} epochs" in gives
    assert re.search(r"ends at \d+\.\d\d% on [\d,]+ test images", gives) and re.search(r"\d+ s on 2 idle cores", gives)


def test_the_first_screens_figure_is_an_official_row():
    """The first screen's accuracy, p-value and times are those of a 25-run row of fastcifar in
    bench/results/official.jsonl, on the device and date the screen names."""
    import json

    row = next(ln for ln in FIRST_SCREEN.splitlines() if "(the default) | 25 |" in ln)
    said = re.search(
        r"\| ([\d.]+) ± ([\d.]+) \(([\d.]+)\); p = ([\d.e-]+) .*\| ([\d.]+) \(([\d.]+)\) \| (.+) \| (.+) \|$", row
    )
    acc, std, low, p, time_s, time_max, device, date = said.groups()
    official = [json.loads(ln) for ln in (ROOT / "bench" / "results" / "official.jsonl").read_text().splitlines()]
    matches = [
        r
        for r in official
        if r["runs"] == 25
        and r["trainer"].startswith("fastcifar:")
        and (f"{r['acc_mean']:.2f}", f"{r['acc_std']:.2f}", f"{r['time_mean_s']:.2f}", f"{r['time_max_s']:.2f}")
        == (acc, std, time_s, time_max)
        and f"{r['p_value']:.2g}" == f"{float(p):.2g}"
    ]
    assert matches, row
    assert all(device.removeprefix("one ") in r["device"] and r["date"] == date for r in matches)
    assert float(low) <= float(acc)


def test_readme_says_where_the_runs_lines_are_and_what_they_count(uninterrupted):
    """The README's CPU runs section names the estimate's line, the took line and what train and
    wall count; a run's console has them where and as it says."""
    section = README[README.index("## CPU runs") :]
    section = section[: section.index("\n## ")]
    for promise in ("`run 1: about ... in all`", "`run 1: took ... in all`", "`train`", "`wall`"):
        assert promise in section, promise
    lines = uninterrupted["stdout"].splitlines()
    estimate = next(i for i, ln in enumerate(lines) if ln.startswith("run 1: about ") and " in all " in ln)
    for before in ("engine: ", "data: ", "logs: "):
        assert next(i for i, ln in enumerate(lines) if ln.startswith(before)) < estimate, before
    assert not [ln for ln in lines[:estimate] if ln.startswith(("run 1:", "   1 "))], "the estimate is the run's first"
    assert "set-up to model file" in lines[estimate] and "not counted: " in lines[estimate]
    took = next(
        i for i, ln in enumerate(lines) if ln.startswith("run 1: took ") and " in all, set-up to model file" in ln
    )
    assert "of training steps" in lines[took - 1] and "since the process started" in lines[took - 1]


def test_the_cpu_warning_names_the_first_screens_cpu_run():
    """A full preset on the CPU warns and names the short run: the first screen's flags."""
    from fastcifar.core.config import from_preset
    from fastcifar.run import report

    note = report.cpu_note(from_preset("fast-jitter"), torch.device("cpu"))
    suggested = re.search(r"\((--subset [^)]*)\)", note).group(1)
    assert suggested in CPU_RUN.group(1), (suggested, CPU_RUN.group(1))


def test_the_architecture_map_names_every_module():
    """docs/architecture.md names every folder and module of fastcifar/ and kernels/."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for top in ("fastcifar", "kernels"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name in ("__init__.py", "__main__.py"):
                continue
            if not re.search(rf"(?<![\w.]){re.escape(path.stem)}\.py\b", text):
                missing.append(str(path.relative_to(ROOT)))
        for folder in sorted(p for p in (ROOT / top).rglob("*") if p.is_dir() and p.name != "__pycache__"):
            if f"{folder.name}/" not in text:
                missing.append(str(folder.relative_to(ROOT)) + "/")
    assert not missing, f"docs/architecture.md does not name: {missing}"
    assert "(docs/architecture.md)" in README[README.index("## Architecture") :]
