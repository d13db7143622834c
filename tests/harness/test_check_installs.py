"""scripts/check_installs.py: the judging of pip's dry-run reports (the resolving needs the registry
and is not a CI test; bench/results/installs.jsonl holds its rows). Reports made up here, in pip's
``--report`` format."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import check_installs  # noqa: E402


def report(**versions) -> dict:
    return {"install": [{"metadata": {"name": name, "version": v}} for name, v in versions.items()]}


VOLTA = report(
    **{"torch": "2.10.0", "nvidia-cuda-runtime-cu12": "12.8.90", "nvidia_dali_cuda120": "2.4.0", "numpy": "2.3.5"}
)
CU130 = report(**{"torch": "2.14.1", "nvidia-cuda-runtime": "13.0.96", "nvidia-dali-cuda130": "2.4.0"})


@pytest.mark.parametrize(
    "resolved,caps,ok,runs",
    [
        (VOLTA, ["7.0"], True, {"7.0": {"torch": True, "dali": True}}),
        (CU130, ["7.0"], False, {"7.0": {"torch": False, "dali": False}}),  # the default line on a V100
        (CU130, ["7.5", "9.0", "12.0"], True, None),
        # a release without an entry: unknown, except that CUDA 13 holds nothing below sm_75
        (report(torch="2.12.0", **{"nvidia-cuda-runtime": "13.0.96", "nvidia-dali-cuda130": "2.4.0"}), ["7.0"], False,
         {"7.0": {"torch": False, "dali": False}}),
        (report(torch="2.12.0", **{"nvidia-cuda-runtime": "13.0.96", "nvidia-dali-cuda130": "2.4.0"}), ["9.0"], False,
         {"9.0": {"torch": None, "dali": True}}),
        # two DALI builds (the two extras combined) write the same files
        (report(**{**{i["metadata"]["name"]: i["metadata"]["version"] for i in CU130["install"]},
                   "nvidia-dali-cuda120": "2.4.0"}), ["9.0"], False, {"9.0": {"torch": True, "dali": False}}),
    ],
)  # fmt: skip
def test_each_line_is_judged_against_the_capabilities_it_claims(resolved, caps, ok, runs):
    row = check_installs.judge(resolved, "gen", caps, "pip install -e '.[x]'")
    assert row["ok"] is ok, row
    if runs is not None:
        assert row["runs_on"] == runs


def test_the_volta_row_names_its_sources_and_versions():
    row = check_installs.judge(VOLTA, "Volta (V100)", ["7.0"], "pip install -e '.[volta]'")
    assert (row["torch"], row["torch_cuda"], row["numpy"], row["dali"]) == (
        "2.10.0",
        "12.8",
        "2.3.5",
        ["nvidia-dali-cuda120 2.4.0"],
    )
    assert "sm_70" in row["arch_list"] and row["arch_list_source"].startswith("issue 69")


def test_main_appends_one_row_and_fails_on_a_bad_line(tmp_path):
    (tmp_path / "volta.json").write_text(json.dumps(VOLTA))
    (tmp_path / "dali.json").write_text(json.dumps(CU130))
    (tmp_path / "pip-config.txt").write_text("global.constraint='/c.txt'\n")
    out = tmp_path / "installs.jsonl"
    good = ["Volta (V100)|7.0|volta", "Turing and newer|7.5 9.0|dali"]
    assert check_installs.main([str(tmp_path), str(out), "pip 26.3 from /x", "26", *good]) == 0
    assert check_installs.main([str(tmp_path), str(out), "pip 26.3 from /x", "26", "Volta (V100)|7.0|dali"]) == 1
    first, second = (json.loads(line) for line in out.read_text().splitlines())
    assert (
        first["pip"] == "pip 26.3"
        and first["received_mb"] == 26
        and first["pip_config"] == ["global.constraint='/c.txt'"]
    )
    assert [r["ok"] for r in first["lines"]] == [True, True] and [r["ok"] for r in second["lines"]] == [False]
    assert first["date"] and "commit" in first


@pytest.mark.parametrize("args, out", [([], "runs/installs.jsonl"), (["--record"], "bench/results/installs.jsonl")])
def test_the_row_goes_to_the_users_folder_unless_recorded(args, out, tmp_path):
    """check_installs.sh in a copy whose python3, pip and judging Python only record their calls: the
    row goes to runs/ (the user's, ignored by git), to bench/results/ only with --record; an unknown
    argument is one line, exit 2."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "check_installs.sh", tree / "scripts")
    bin_, calls = tmp_path / "bin", tmp_path / "calls"
    bin_.mkdir()
    fakes = {
        # python3 -m venv DIR: a venv whose pip does nothing; python3 -c ...: 0 bytes received
        "python3": 'if [ "$1" = -m ]; then mkdir -p "$3/bin"; printf "#!/bin/sh\\n" > "$3/bin/pip"; '
        'chmod +x "$3/bin/pip"; else echo 0; fi\n',
        "judge": f'echo "$3" >> {calls}\n',  # scripts/check_installs.py WORK OUT ...
    }
    for name, body in fakes.items():
        (bin_ / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_ / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}", PYTHON=str(bin_ / "judge"))
    env.pop("OUT", None)
    script = ["bash", "scripts/check_installs.sh"]
    proc = subprocess.run([*script, *args], cwd=tree, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert calls.read_text().splitlines() == [out] and (tree / out).parent.is_dir()
    proc = subprocess.run([*script, "--bogus"], cwd=tree, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "unknown argument '--bogus'" in proc.stderr
