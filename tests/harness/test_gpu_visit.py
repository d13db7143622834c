"""scripts/gpu_visit.sh fits the GPU machine: every stage, in its CPU dry run, leaves at most 8 files
in $OUT at most two folders deep, prints its table even when a step fails, and bundles its logs.
scripts/gpu_visit_report.py's checks fail on a loss that does not fall and on graphed and eager
runs that disagree."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import forkserver
import pytest

from fastcifar.core.config import from_preset
from fastcifar.core.presets import DEFAULT_PRESET
from fastcifar.run.report import EpochRecord, RunResult

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_visit.sh"
STAGES = [
    ["check"],
    ["engines"],
    ["bench"],
    ["kernels"],
    ["accuracy", "resnet9", "3"],
    ["dali"],
    ["race"],
    ["emulated", DEFAULT_PRESET, "8"],
    ["nccl2"],
    ["conv"],
    ["screen"],
    ["deterministic"],
    ["levers"],  # the real candidate, fast-levers: its every lever must parse over the default
    ["sweep"],
]
MAX_FILES, MAX_DEPTH = 8, 2  # what comes back from the GPU machine's $OUT


def visit(tmp_path, *args, **env):
    out = tmp_path / "out"
    data = tmp_path / "cifar.tar.gz"
    data.write_bytes(b"")  # the dry run only checks that it exists
    e = {**os.environ, "DRY_RUN": "1", "OUT": str(out), "DATA": str(data), "PYTHON": sys.executable, **env}
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=tmp_path, env=e, capture_output=True, text=True, timeout=120
    )
    return proc, out


def tree(out: Path) -> list[Path]:
    return [p for p in out.rglob("*")]


@pytest.mark.parametrize("args", STAGES, ids=lambda a: a[0])
def test_stage_dry_run_fits_the_machines_limits(tmp_path, args):
    proc, out = visit(tmp_path, *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    files = [p for p in tree(out) if p.is_file()]
    assert 0 < len(files) <= MAX_FILES, files
    assert all(len(p.relative_to(out).parts) <= MAX_DEPTH for p in tree(out))
    # accuracy-PRESET, emulated-PRESET-xN: two in one call keep both
    stage = {"accuracy": "-".join(args[:2]), "emulated": f"emulated-{'-x'.join(args[1:3])}"}.get(args[0], args[0])
    assert {p.name for p in files} == {f"{stage}-table.md", f"{stage}-logs.tar.gz", f"{stage}-results.tar.gz"}
    table = (out / f"{stage}-table.md").read_text()
    assert "| step | result | seconds |" in table and table in proc.stdout
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows and all("| ok |" in r for r in rows), table
    with tarfile.open(out / f"{stage}-logs.tar.gz") as tar:
        logs = [m.name for m in tar.getmembers() if m.name.endswith(".log")]
    assert len(logs) >= len(rows), (logs, rows)


def test_engines_stage_covers_every_combination(tmp_path):
    proc, out = visit(tmp_path, "engines")
    table = (out / "engines-table.md").read_text()
    for name in (
        "k-auto-g-on",
        "k-auto-g-off",
        "k-triton-g-on",
        "k-triton-g-off",
        "k-torch-g-on",
        "k-torch-g-off",
        "nccl-1rank",
        "engine-checks",
    ):
        assert f"| {name} |" in table, table
    one_rank = [line for line in proc.stdout.splitlines() if "--nproc_per_node 1" in line]
    # a real NCCL group of one: its buckets, comm stream and captured collectives run
    assert one_rank and all("--comm bucketed --dist-group always --cuda-graphs on" in line for line in one_rank), (
        one_rank
    )
    # torchrun of $PYTHON's own torch, as every other step runs $PYTHON
    assert f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node 1" in proc.stdout


def test_check_stage_runs_the_cuda_kernel_cases_once(tmp_path):
    """cuda-tests runs every cuda-marked test, the kernels' full-size cases included; kernel-tests
    runs the rest of the kernel files, so the stage's budget is not spent on them twice, and the two
    loader tests that are not cuda-marked but run the Triton augmentation on CUDA tensors on a GPU."""
    proc, _ = visit(tmp_path, "check")
    assert "pytest -q -m cuda tests" in proc.stdout
    assert "pytest -q -m not cuda tests/kernels/test_kernel_bn_act_pool.py" in proc.stdout
    # the loader tests that run the Triton augmentation on CUDA tensors only on a GPU machine
    kernel_step = next(line for line in proc.stdout.splitlines() if line.startswith("=== kernel-tests"))
    for test in (
        "tests/unit/test_loader.py::test_triton_loader_batch_under_cuda_layouts",
        "tests/unit/test_loader.py::test_loader_with_triton_kernels_equals_the_reference",
    ):
        assert test in kernel_step, kernel_step
        path, name = test.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), f"{test} no longer exists"


def test_accuracy_stage_runs_seeds_in_order_and_says_where_to_go_on(tmp_path):
    proc, out = visit(tmp_path, "accuracy", "fast", "7")
    table = (out / "accuracy-fast-table.md").read_text()
    assert "| fast-seed7 |" in table and "| fast-seed8 |" in table
    assert "next chunk: bash scripts/gpu_visit.sh accuracy fast 10" in proc.stdout


def test_two_accuracy_stages_in_one_call_keep_both_tables(tmp_path):
    """The first GPU visit ran `accuracy resnet9` then `accuracy fast` in one call, and the second
    stage's files replaced the first's: the resnet9 table was lost."""
    _, out = visit(tmp_path, "accuracy", "resnet9", "0")
    _, out = visit(tmp_path, "accuracy", "fast", "0")
    assert "| resnet9-seed0 |" in (out / "accuracy-resnet9-table.md").read_text()
    assert "| fast-seed0 |" in (out / "accuracy-fast-table.md").read_text()
    assert len([p for p in tree(out) if p.is_file()]) <= MAX_FILES


def test_race_stage_runs_fastcifar_first_then_each_public_script_in_the_folder_its_loader_reads(tmp_path):
    proc, out = visit(tmp_path, "race", RACE_RUNS="25", RACE_CALL="visit 8", RACE_COMMIT="abc1234")
    assert proc.returncode == 0, proc.stdout[-2000:]
    table = (out / "race-table.md").read_text()
    names = [
        f"{DEFAULT_PRESET}-runs",
        "export-tensors",
        "prepare-peers",
        "hiverge",
        "airbench94_muon",
        "airbench94",
        "race-table",
    ]
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1:] == names, table  # in this order: the contender before the public scripts' minutes
    lines = [line for line in proc.stdout.splitlines() if line.startswith("dry run:")]
    assert any(f"--preset {DEFAULT_PRESET} --seed 0 --runs 25" in line for line in lines)
    assert not any("--preset fast --seed" in line or "resnet9" in line for line in lines)  # the default alone
    folder = next(line for line in lines if "export_tensors.py" in line).split("--out ")[1].strip()
    assert folder.endswith("/race/cifar10")
    prepare = next(line for line in lines if "race.py prepare" in line)
    assert f"--images {folder} --runs 25" in prepare and ".stage/race" in prepare
    for name, file in (
        ("hiverge", "cifar10_speedrun.py"),
        ("airbench94_muon", "airbench94_muon.py"),
        ("airbench94", "airbench94.py"),
    ):  # each in its own folder, where race.py links cifar10
        run = next(line for line in lines if line.endswith(f"'{file}'"))
        assert f"cd '{folder[: -len('cifar10')]}{name}'" in run
    report = next(line for line in lines if "race.py report" in line)
    for part in (
        f"--data {tmp_path / 'cifar.tar.gz'}",
        "--jsonl bench/results/official.jsonl",
        "--call visit 8",
        "--commit abc1234",
    ):
        assert part in report, report


def test_race_stage_races_the_presets_it_is_given(tmp_path):
    proc, out = visit(tmp_path, "race", RACE_PRESETS="fast-muon320 fast", RACE_RUNS="5")
    table = (out / "race-table.md").read_text()
    assert "| fast-muon320-runs |" in table and "| fast-runs |" in table, table
    assert any("--preset fast --seed 0 --runs 5" in line for line in proc.stdout.splitlines())


def test_race_stage_confirms_a_screened_variant_beside_the_peers(tmp_path):
    proc, out = visit(tmp_path, "race", RACE_FLAGS="--epochs 7 --widths 64,288,288", RACE_PEERS="airbench94_muon")
    assert proc.returncode == 0, proc.stdout[-2000:]
    runs = [line for line in proc.stdout.splitlines() if line.startswith("dry run:") and "fastcifar.train" in line]
    assert len(runs) == 1, runs
    assert runs[0].endswith(f"--preset {DEFAULT_PRESET} --seed 0 --runs 25 --quiet --epochs 7 --widths 64,288,288")
    assert table_steps(out, "race")[-2:] == ["airbench94_muon", "race-table"]
    proc, out = visit(tmp_path, "race", RACE_FLAGS="--epochs 7 --seed 3")  # refused before any run
    assert proc.returncode == 1
    assert "dry run:" not in proc.stdout
    assert table_steps(out, "race") == ["race-flags"]
    assert "refused: the stage sets --seed itself" in (out / "race-table.md").read_text()


def test_race_stage_without_a_preset_to_race_fails_before_the_public_scripts(tmp_path):
    """When the default preset cannot be read (here: a Python that only stages the copy), the race
    stops at once, not after the public scripts' minutes with no contender in its table."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\n[ "$1" = scripts/stage_tree.py ] && exec {sys.executable} "$@"\nexit 1\n')
    python.chmod(0o755)
    proc, out = visit(tmp_path, "race", PYTHON=str(python))
    assert proc.returncode == 1
    assert "no preset to race" in proc.stdout
    assert not any(line.startswith("=== hiverge") for line in proc.stdout.splitlines())
    proc, out = visit(tmp_path, "bench", PYTHON=str(python))
    assert proc.returncode == 1
    assert "| bench-step-default | FAIL: the default preset could not be read" in (out / "bench-table.md").read_text()


def test_a_stage_that_cannot_stage_its_copy_stops_before_any_step(tmp_path):
    """No Python to lay out the importable copy (scripts/stage_tree.py): one failed row, the table
    and bundles all the same, and no step run from the checkout instead."""
    proc, out = visit(tmp_path, "check", PYTHON="false")
    assert proc.returncode == 1
    table = (out / "check-table.md").read_text()
    assert "| stage-tree | FAIL" in table and "| versions |" not in table
    assert not any(line.startswith("=== versions") for line in proc.stdout.splitlines())


@pytest.mark.parametrize("failing", ["export-tensors", "prepare-peers"])
def test_race_stage_skips_the_public_scripts_without_their_images_but_still_reports(tmp_path, failing):
    proc, out = visit(tmp_path, "race", DRY_FAIL=failing)
    table = (out / "race-table.md").read_text()
    assert f"| {failing} | FAIL (exit 1) |" in table
    assert not any(line.startswith(("=== hiverge", "=== airbench94")) for line in proc.stdout.splitlines())
    assert "| race-table | ok |" in table  # fastcifar's runs are still reported and filed


def test_race_stage_keeps_time_for_its_table(tmp_path):
    """The public scripts' limits leave the report 40 s: a script that would run past the budget is
    cut, and one with under 30 s left is skipped, so the table and the jsonl rows always come."""
    proc, out = visit(tmp_path, "race", STAGE_BUDGET_S="100")  # a dry run's steps take no time: 60 s of room
    limits = {
        line.split()[1]: int(line.split("(limit ")[1].split("s)")[0])
        for line in proc.stdout.splitlines()
        if line.startswith("=== ")
    }
    # budget - 40 s less the seconds bash counts as spent: 60 on an idle machine, a few less under load
    assert all(50 <= limits[name] <= 60 for name in ("hiverge", "airbench94_muon", "airbench94")), limits
    proc, out = visit(tmp_path, "race", STAGE_BUDGET_S="60")  # 20 s of room: no public script starts
    table = (out / "race-table.md").read_text()
    for name in ("hiverge", "airbench94_muon", "airbench94"):
        assert f"| {name} | skipped: stage budget spent |" in table, table
    assert "| race-table | ok |" in table


def test_race_stage_runs_the_public_scripts_it_is_given_in_their_order(tmp_path):
    proc, out = visit(tmp_path, "race", RACE_PEERS="airbench94 hiverge")
    started = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("=== ")]
    assert started[-3:] == ["airbench94", "hiverge", "race-table"] and "airbench94_muon" not in started
    proc, out = visit(tmp_path, "race", RACE_PEERS="airbench96")  # a typo is a failed step, not a silent skip
    assert proc.returncode == 1
    assert "| airbench96 | FAIL: not a public script the race knows" in (out / "race-table.md").read_text()


def test_race_stage_without_data_says_so(tmp_path):
    proc, out = visit(tmp_path, "race", DATA=str(tmp_path / "missing"))
    assert proc.returncode == 1
    assert "the race needs real data" in proc.stdout
    assert (out / "race-table.md").is_file()


def test_emulated_stage_runs_the_preset_at_n_emulated_ranks_and_files_rows(tmp_path):
    proc, out = visit(tmp_path, "emulated", DEFAULT_PRESET, "8", EMULATED_CALL="visit 9", EMULATED_COMMIT="abc1234")
    assert proc.returncode == 0, proc.stdout[-2000:]
    table = (out / f"emulated-{DEFAULT_PRESET}-x8-table.md").read_text()
    assert f"| {DEFAULT_PRESET}-x8 | ok |" in table and "| emulated-table | ok |" in table, table
    lines = [line for line in proc.stdout.splitlines() if line.startswith("dry run:")]
    train = next(line for line in lines if "fastcifar.train" in line)
    assert f"--preset {DEFAULT_PRESET} --emulate-ranks 8 --seed 0 --runs 10 --quiet" in train
    assert f"--data {tmp_path / 'cifar.tar.gz'}" in train
    report = next(line for line in lines if "gpu_visit_report.py emulated" in line)
    for part in ("--jsonl bench/results/multi_gpu.jsonl", "--call visit 9", "--commit abc1234"):
        assert part in report, report
    proc, _ = visit(tmp_path, "emulated", "fast", "4", "25")  # RUNS
    assert "--preset fast --emulate-ranks 4 --seed 0 --runs 25" in proc.stdout
    proc, out = visit(tmp_path, "emulated", "fast", "4", DATA=str(tmp_path / "missing"))
    assert proc.returncode == 1 and "emulated needs real data" in proc.stdout


def test_conv_stage_sets_the_fused_conv_beside_cudnn_in_one_call(tmp_path):
    """Issue 50: the kernel table first, then the default preset's graphed step and its runs on
    official data, each both ways, and the race's report over the two sets of runs."""
    proc, out = visit(tmp_path, "conv", CONV_CALL="visit 9", CONV_COMMIT="abc1234")
    assert proc.returncode == 0, proc.stdout[-2000:]
    steps = [
        line.split("|")[1].strip()
        for line in (out / "conv-table.md").read_text().splitlines()
        if line.startswith("| ") and "---" not in line
    ][1:]
    assert steps == [
        "bench-conv",
        "sweep-conv",
        "step-cudnn",
        "step-fused",
        f"{DEFAULT_PRESET}-cudnn",
        f"{DEFAULT_PRESET}-fused",
        "conv-table",
    ], steps
    assert any(
        line.endswith("bench/sweep_conv_stats.py") for line in proc.stdout.splitlines() if line.startswith("dry run:")
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("dry run:")]
    step_lines = [line for line in lines if "bench_step.py" in line]
    batch = from_preset().batch_size
    assert step_lines[0].endswith(f"--preset {DEFAULT_PRESET} --batches {batch} --graphs on --kernels auto")
    assert step_lines[1].endswith(
        f"--preset {DEFAULT_PRESET} --batches {batch} --graphs on --kernels auto --fused-conv"
    )
    runs = [line for line in lines if "fastcifar.train" in line]
    assert runs[0].endswith(f"--preset {DEFAULT_PRESET} --seed 0 --runs 10 --quiet")
    assert runs[1].endswith(f"--preset {DEFAULT_PRESET} --seed 0 --runs 10 --quiet --fused-conv")
    assert all(f"--data {tmp_path / 'cifar.tar.gz'}" in r for r in runs)
    report = next(line for line in lines if "race.py report" in line)
    for part in ("--jsonl bench/results/official.jsonl", "--call visit 9", "--commit abc1234"):
        assert part in report, report
    # the cuDNN runs get at most half of what is left but 40 s for the table, the fused ones the rest
    limits = {
        line.split(" (limit ")[0][4:]: int(line.split(" (limit ")[1].split("s)")[0])
        for line in proc.stdout.splitlines()
        if line.startswith("=== ")
    }
    assert limits[f"{DEFAULT_PRESET}-cudnn"] <= (530 - 40) // 2 < limits[f"{DEFAULT_PRESET}-fused"] <= 530 - 40
    assert limits["conv-table"] == 40
    proc, _ = visit(tmp_path, "conv", DATA=str(tmp_path / "missing"))
    assert proc.returncode == 1 and "conv needs real data" in proc.stdout


def table_steps(out: Path, stage: str) -> list[str]:
    return [
        line.split("|")[1].strip()
        for line in (out / f"{stage}-table.md").read_text().splitlines()
        if line.startswith("| ") and "---" not in line
    ][1:]


@pytest.mark.slow  # over 2 s on 2 cores
def test_screen_stage_runs_the_default_then_each_variant_and_reports_them_together(tmp_path):
    """Issues 45 and 50: the default preset, then each variant in SCREEN (its flags added), 10 runs
    each from seed 0, and the race's report over all of them into official.jsonl."""
    proc, out = visit(
        tmp_path,
        "screen",
        SCREEN="--epochs 7;--widths 64,288,288 --epochs 7.5",
        SCREEN_CALL="visit 10",
        SCREEN_COMMIT="abc1234",
    )
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert table_steps(out, "screen") == [
        DEFAULT_PRESET,
        "v1-epochs-7",
        "v2-widths-64-288-288-epochs-7.5",
        "screen-table",
    ]
    runs = [line for line in proc.stdout.splitlines() if line.startswith("dry run:") and "fastcifar.train" in line]
    assert runs[0].endswith(f"--preset {DEFAULT_PRESET} --seed 0 --runs 10 --quiet")
    assert runs[1].endswith(f"--preset {DEFAULT_PRESET} --seed 0 --runs 10 --quiet --epochs 7")
    assert runs[2].endswith(f"--preset {DEFAULT_PRESET} --seed 0 --runs 10 --quiet --widths 64,288,288 --epochs 7.5")
    report = next(line for line in proc.stdout.splitlines() if line.startswith("dry run:") and "race.py report" in line)
    for part in ("--jsonl bench/results/official.jsonl", "--call visit 10", "--commit abc1234", "--fastcifar "):
        assert part in report, report
    # each variant is capped (10 runs: 8 s a run + 90 s), so a stuck one leaves the others their time
    limits = {
        line.split(" (limit ")[0][4:]: int(line.split(" (limit ")[1].split("s)")[0])
        for line in proc.stdout.splitlines()
        if line.startswith("=== ")
    }
    assert limits["v1-epochs-7"] == 170 and limits["screen-table"] == 40
    proc, out = visit(tmp_path, "screen", SCREEN="--epochs 7", SCREEN_RUNS="25")
    assert "--epochs 7" in proc.stdout and "--runs 25" in proc.stdout
    # SCREEN set but empty: the default alone; unset: the prepared variants, each valid
    proc, out = visit(tmp_path, "screen", SCREEN="")
    assert proc.returncode == 0 and table_steps(out, "screen") == [DEFAULT_PRESET, "screen-table"]
    env = {k: v for k, v in os.environ.items() if k != "SCREEN"}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "screen"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **env,
            "DRY_RUN": "1",
            "OUT": str(tmp_path / "out2"),
            "DATA": str(tmp_path / "cifar.tar.gz"),
            "PYTHON": sys.executable,
        },
    )
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert len(table_steps(tmp_path / "out2", "screen")) >= 4


@pytest.mark.parametrize(
    "variants, message",
    [
        ("--epochs 7;--widht 64", "variant '--widht 64' refused: unrecognized arguments: --widht 64"),
        ("--epochs 0", "variant '--epochs 0' refused: --epochs must lie in (0, 1000], not 0"),
        # split as bash splits it for the run: quotes stay, and fail here rather than on the GPU
        ('--widths "64,256,256"', """variant '--widths "64,256,256"' refused: argument --widths"""),
        # a variant's runs are pooled by its recipe's name: one that is the default's, or another's, would mix
        ("--epochs 7;;--tta 1", f"variant '' refused: it trains the {DEFAULT_PRESET} recipe itself"),
        (
            f"--epochs {from_preset().epochs}",
            f"variant '--epochs {from_preset().epochs}' refused: it trains the {DEFAULT_PRESET} recipe itself",
        ),
        ("--epochs 7;--epochs 7.0", "variant '--epochs 7.0' refused: it trains the same recipe as '--epochs 7'"),
        ("--seed 5", "variant '--seed 5' refused: the stage sets --seed itself"),
        ("--preset=fast", "variant '--preset=fast' refused: the stage sets --preset itself"),
    ],
)
@pytest.mark.slow  # over 2 s on 2 cores
def test_screen_stage_refuses_a_bad_variant_before_any_run(tmp_path, variants, message):
    proc, out = visit(tmp_path, "screen", SCREEN=variants)
    assert proc.returncode == 1
    assert table_steps(out, "screen") == ["screen-flags"]
    assert message in (out / "screen-table.md").read_text()
    assert "dry run:" not in proc.stdout  # no run started
    proc, _ = visit(tmp_path, "screen", DATA=str(tmp_path / "missing"))
    assert proc.returncode == 1 and "screen needs real data" in proc.stdout


def test_bench_stage_times_the_default_presets_step_first(tmp_path):
    """The race times the default preset, so its step breakdown (its network at its batch) comes first,
    before the budget can run out; the kernel benchmark, graph-replay timed and slow to compile, is a
    stage of its own."""
    proc, out = visit(tmp_path, "bench")
    steps = [
        line.split("|")[1].strip()
        for line in (out / "bench-table.md").read_text().splitlines()
        if line.startswith("| bench-")
    ]
    assert steps[0] == "bench-step-default" and "bench-bn" not in steps, steps
    assert f"bench_step.py --preset {DEFAULT_PRESET} --batches {from_preset().batch_size}" in proc.stdout
    # then one of its 8 ranks' step (issue 46), graphs on, as rank 0 of a fake 8-rank group
    assert steps[1] == "bench-step-8rank", steps
    assert f"bench_step.py --preset {DEFAULT_PRESET} --fake-world 8 --graphs off on --kernels auto" in proc.stdout
    proc, out = visit(tmp_path, "kernels")
    assert "| bench-bn | ok |" in (out / "kernels-table.md").read_text()
    # the default preset's blocks, in both the benchmark and the launch sweep: the indices the stage
    # names are the default's blocks in bench/kernel_registers.py (a new default moves them)
    from bench.kernel_registers import DEFAULT_BLOCKS, PRESET_BLOCKS

    bench = next(
        line for line in proc.stdout.splitlines() if line.startswith("dry run:") and "bench_bn_act_pool.py" in line
    )
    indices = [int(i) for i in bench.split("--blocks ")[1].split()]
    assert [PRESET_BLOCKS[i] for i in indices] == [(b, c, s, "gelu", pool) for b, c, s, pool in DEFAULT_BLOCKS]
    assert len(indices) == 6
    assert f"sweep_bn_act_pool.py --blocks {' '.join(map(str, indices))}" in proc.stdout


def test_a_failing_step_still_prints_the_table_and_bundles(tmp_path):
    proc, out = visit(tmp_path, "check", DRY_FAIL="cuda-tests")
    assert proc.returncode == 1
    table = (out / "check-table.md").read_text()
    assert "| cuda-tests | FAIL (exit 1) |" in table and "| kernel-tests | ok |" in table
    assert table in proc.stdout
    assert (out / "check-logs.tar.gz").stat().st_size > 0


def test_spent_budget_skips_steps_and_says_so(tmp_path):
    proc, out = visit(tmp_path, "check", STAGE_BUDGET_S="5")
    assert proc.returncode == 1
    assert "skipped: stage budget spent" in (out / "check-table.md").read_text()


def test_deterministic_stage_runs_the_default_then_twice_deterministic_and_files_a_row(tmp_path):
    proc, out = visit(tmp_path, "deterministic", DETERMINISTIC_CALL="visit 13", DETERMINISTIC_COMMIT="abc1234")
    assert proc.returncode == 0, proc.stdout[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("dry run:")]
    runs = [line for line in lines if "fastcifar.train" in line]
    assert [line.split("--out-dir ")[1].split()[0].rsplit("/", 1)[1] for line in runs] == [
        "deterministic-normal",
        "deterministic-a",
        "deterministic-b",
    ]
    for line, deterministic in zip(runs, (False, True, True), strict=True):
        assert f"--preset {DEFAULT_PRESET} --seed 0 --runs 3 --quiet" in line
        assert f"--data {tmp_path / 'cifar.tar.gz'}" in line
        assert line.endswith("--deterministic") is deterministic, line
    (checks,) = [line for line in lines if "gpu_visit_report.py deterministic" in line]
    for part in ("--jsonl bench/results/deterministic.jsonl", "--call visit 13", "--commit abc1234"):
        assert part in checks, checks
    proc, _ = visit(tmp_path, "deterministic", DETERMINISTIC_RUNS="5")
    assert proc.stdout.count(f"--preset {DEFAULT_PRESET} --seed 0 --runs 5 --quiet") == 6  # logged and dry-run


def test_sweep_stage_times_the_default_and_a_shorter_preset_at_1_2_4_workers_beside_runs_n(tmp_path):
    proc, out = visit(tmp_path, "sweep", SWEEP_CALL="visit 14")
    assert proc.returncode == 0, proc.stdout[-2000:]
    runs = [line for line in proc.stdout.splitlines() if line.startswith("dry run:") and "bench_sweep.py" in line]
    assert len(runs) == 2, runs
    for line in runs:
        for part in ("--device cuda --full", f"--preset {DEFAULT_PRESET} --runs 12 --per-device 1,2,4", "--record"):
            assert part in line, line
        assert line.endswith("--label visit 14") and f"--data {tmp_path / 'cifar.tar.gz'}" in line
    assert "--epochs" not in runs[0] and "--epochs 2 " in runs[1]
    assert table_steps(out, "sweep") == ["sweep-reuse", "sweep-default", "sweep-short"]
    (reuse,) = [line for line in proc.stdout.splitlines() if line.startswith("dry run:") and "test_engine.py" in line]
    assert reuse.endswith("-m pytest -q -p no:cacheprovider tests/unit/test_engine.py -k gpu"), reuse
    proc, _ = visit(tmp_path, "sweep", SWEEP_RUNS="20", SWEEP_EPOCHS="3")
    assert proc.stdout.count("--runs 20 --per-device 1,2,4") == 4 and "--epochs 3 " in proc.stdout


def test_unknown_stage_is_refused(tmp_path):
    proc, _ = visit(tmp_path, "everything")
    assert proc.returncode == 2 and proc.stderr.startswith("usage:")


# --- the report's checks --------------------------------------------------------------------------


def write_run(root: Path, name: str, losses, preset="fast", seed=0, acc=91.0, engine=None, config=None, **doc):
    epochs = [
        EpochRecord(
            run=1,
            epoch=i + 1,
            lr=0.1,
            train_time=1.0,
            train_loss=v,
            train_acc=50.0,
            test_time=0.1,
            test_loss=v,
            test_acc=acc,
            total_train_time=i + 1.0,
        )
        for i, v in enumerate(losses)
    ]
    result = RunResult(run=1, seed=seed, test_acc=acc, train_time=float(len(losses)), wall_time=9.0, epochs=epochs)
    folder = root / name / f"2026-11-22-x{seed}"
    folder.mkdir(parents=True)
    doc = {
        "config": {"preset": preset, **(config or {})},
        "results": [dataclasses.asdict(result)],
        "engine": engine or {},
        **doc,
    }
    (folder / "summary.json").write_text(json.dumps(doc))


def report(*args):
    return forkserver.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_visit_report.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_engine_report_passes_agreeing_runs_and_fails_the_rest(tmp_path):
    good = tmp_path / "good"
    write_run(good, "k-triton-g-on", [1.9, 1.4])
    write_run(good, "k-triton-g-off", [1.9, 1.41])
    proc = report("engines", good)
    assert proc.returncode == 0, proc.stdout
    assert "| k-triton-g-on | 1.9000 > 1.4000 |" in proc.stdout

    flat = tmp_path / "flat"
    write_run(flat, "k-torch-g-on", [1.9, 2.0])
    proc = report("engines", flat)
    assert proc.returncode == 1 and "did not fall" in proc.stdout

    apart = tmp_path / "apart"
    write_run(apart, "k-torch-g-on", [1.9, 1.0])
    write_run(apart, "k-torch-g-off", [1.9, 1.4])
    proc = report("engines", apart)
    assert proc.returncode == 1 and "graphed 1.0000 vs eager 1.4000" in proc.stdout

    for engine, ok in (({"comm": "bucketed"}, True), ({}, False)):  # a 1-rank run without a group tests no NCCL
        one = tmp_path / f"one-rank-{ok}"
        write_run(one, "nccl-1rank", [1.9, 1.4], engine=engine)
        proc = report("engines", one)
        assert (proc.returncode == 0) == ok and ("formed no process group" in proc.stdout) != ok, proc.stdout


def test_accuracy_report_combines_chunks(tmp_path):
    write_run(tmp_path / "a", "fast-seed0", [1.0], seed=0, acc=93.0)
    write_run(tmp_path / "b", "fast-seed1", [1.0], seed=1, acc=95.0)
    proc = report("accuracy", tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 0, proc.stdout
    assert "fast: 2 runs, test acc mean 94.00 ± 1.41 (min 93.00)" in proc.stdout


def test_emulated_report_files_one_row_per_preset_and_rank_count(tmp_path):
    """Fake runs of the default at 8 emulated ranks (two chunks) and one plain run: one row per set,
    device and versions from the runs' own summary.json, the data named as the race names it."""
    runs = tmp_path / "runs"
    machine = {
        "device": {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "world_size": 1},
        "versions": {"torch": "2.11.0", "triton": "3.6.0"},
    }
    accs = [94.1, 93.9, 94.3, 94.2]
    for seed, acc in enumerate(accs):
        write_run(
            runs / f"chunk{seed // 2}",
            "fast-muon320-x8",
            [1.0],
            preset="fast-muon320",
            seed=seed,
            acc=acc,
            config={"emulate_ranks": 8, "batch_size": 2000},
            **machine,
        )
    write_run(
        runs / "plain",
        "fast-muon320",
        [1.0],
        preset="fast-muon320",
        seed=0,
        acc=94.5,
        config={"batch_size": 2000},
        **machine,
    )  # a summary from before the option: 1 rank
    jsonl = tmp_path / "multi_gpu.jsonl"
    jsonl.write_text('{"check": "earlier row"}\n')
    proc = report(
        "emulated", runs, "--jsonl", jsonl, "--data", tmp_path / "cifar10", "--call", "visit 9", "--commit", "abc1234"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| fast-muon320 | 8 | 250 | 4 | 94.12 ± 0.17 (93.90) | 1 |" in proc.stdout, proc.stdout
    assert "has 4 runs; issue 46 asks for at least 10" in proc.stdout
    earlier, *rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert earlier == {"check": "earlier row"}, "rows are appended"
    (one,) = [r for r in rows if r["ranks"] == 1]
    assert one["emulated"] is False and one["runs"] == 1
    (row,) = [r for r in rows if r["ranks"] == 8]
    assert row["device"] == "NVIDIA H100 80GB HBM3" and row["torch"] == "2.11.0" and row["emulated"] is True
    assert row["runs"] == 4 and row["seeds"] == [0, 1, 2, 3] and row["per_rank_batch"] == 250
    assert row["acc_mean"] == pytest.approx(94.125) and row["acc_std"] == pytest.approx(0.17078251)
    assert row["acc_min"] == 93.9 and row["below_bar"] == 1
    assert row["data"] == "other:cifar10" and row["call"] == "visit 9" and row["commit"] == "abc1234"
    assert report("emulated", tmp_path / "empty").returncode == 1  # no runs: the stage fails


# --- export_tensors: our images where the public script's loader reads them ----------------------


@pytest.mark.slow  # over 2 s on 2 cores
def test_export_tensors_writes_what_the_public_loader_reads(tmp_path):
    import numpy as np
    import torch
    from conftest import write_official

    folder, arrays = write_official(tmp_path / "data", per_batch=4, n_test=6)
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "export_tensors.py"),
            "--data",
            str(folder),
            "--out",
            str(tmp_path / "cifar10"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for split, n in (("train", 20), ("test", 6)):
        doc = torch.load(tmp_path / "cifar10" / f"{split}.pt", weights_only=True)  # as torch.load defaults now
        assert doc["images"].dtype == torch.uint8 and tuple(doc["images"].shape) == (n, 32, 32, 3)
        assert doc["labels"].dtype == torch.int64
        x, y = arrays[split]
        np.testing.assert_array_equal(doc["images"].numpy(), x)
        np.testing.assert_array_equal(doc["labels"].numpy(), y)
        assert len(doc["classes"]) == 10
    assert not list((tmp_path / "cifar10").glob("*.tmp"))


@pytest.mark.slow  # over 2 s on 2 cores
def test_export_tensors_refuses_bad_input_in_one_line(tmp_path):
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "export_tensors.py"),
            "--data",
            str(tmp_path / "nothing"),
            "--out",
            str(tmp_path / "cifar10"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("export_tensors: ")
    assert not (tmp_path / "cifar10").exists()


def test_a_relative_python_is_the_callers_in_the_copy_the_stage_runs_from(tmp_path):
    """PYTHON=bin/py (relative to where the visit is started) still names that Python once the
    stage has moved into its importable copy: the steps run it by its absolute path."""
    wrapper = tmp_path / "bin" / "py"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    proc, out = visit(tmp_path, "check", PYTHON="bin/py")
    assert proc.returncode == 0, proc.stdout[-2000:]
    runs = [line for line in proc.stdout.splitlines() if line.startswith("dry run:") and "/py " in line]
    assert runs and all(f"{wrapper} " in line and " bin/py " not in line for line in runs), runs


def test_deterministic_report_passes_the_same_bits_and_names_a_differing_tensor(tmp_path):
    import torch
    from safetensors.torch import save_file

    weights = {"conv.weight": torch.arange(6.0).view(2, 3), "head.weight": torch.ones(3)}
    signed = torch.arange(6.0).view(2, 3)
    signed[0, 0] = -0.0  # the same values as conv.weight, other bits
    for case, b_weights in (("same", weights), ("apart", {**weights, "conv.weight": signed})):
        root = tmp_path / case / "runs"
        for name, tensors, det in (("normal", weights, False), ("a", weights, True), ("b", b_weights, True)):
            write_run(root, f"deterministic-{name}", [1.9, 1.4], config={"deterministic": det}, device={"name": "H100"})
            (folder,) = (root / f"deterministic-{name}").iterdir()
            save_file(tensors, folder / "model.safetensors")
        jsonl = tmp_path / case / "deterministic.jsonl"
        proc = report("deterministic", root, "--jsonl", jsonl, "--call", "visit 13")
        (row,) = [json.loads(line) for line in jsonl.read_text().splitlines()]
        assert row["check"] == "deterministic-bit-exact" and row["call"] == "visit 13" and row["device"] == "H100"
        assert row["time_ratio"] == 1.0 and row["runs"] == 1
        if case == "same":
            assert proc.returncode == 0 and row["ok"], proc.stdout
            assert "| deterministic-a | 1 | 91.00 | 2.000 | 1.000 |" in proc.stdout
        else:
            assert proc.returncode == 1 and not row["ok"]
            assert "model.safetensors: 1 tensors differ (conv.weight)" in row["message"], row


def test_levers_stage_runs_the_stack_the_default_and_the_record_then_each_levers_step(tmp_path):
    """The levers of a candidate preset (here fast-muon9 against the default, fast-jitter: its epochs
    and its jitter off) come from the presets table: each alone and all together in the step bench."""
    proc, out = visit(tmp_path, "levers", LEVERS_PRESET="fast-muon9", LEVERS_CALL="visit 13", LEVERS_COMMIT="abc1234")
    assert proc.returncode == 0, proc.stdout[-2000:]
    files = [p for p in tree(out) if p.is_file()]
    assert {p.name for p in files} == {"levers-table.md", "levers-logs.tar.gz", "levers-results.tar.gz"}
    assert table_steps(out, "levers") == [
        "fast-muon9-x25",
        f"{DEFAULT_PRESET}-x25",
        "export-tensors",
        "prepare-peers",
        "hiverge",
        "bench-levers",
        "bench-augment",
        "fast-muon9-batch-size-1536",
        "fast-muon9-epochs-8.0",
        "levers-table",
    ]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("dry run:")]
    runs = [line for line in lines if "fastcifar.train" in line]
    assert runs[0].endswith("--preset fast-muon9 --seed 0 --runs 25 --quiet")
    assert runs[1].endswith(f"--preset {DEFAULT_PRESET} --seed 0 --runs 25 --quiet")
    assert runs[2].endswith("--preset fast-muon9 --seed 0 --runs 10 --quiet --batch-size 1536")
    assert runs[3].endswith("--preset fast-muon9 --seed 0 --runs 10 --quiet --epochs 8.0")
    folder = next(line for line in lines if "export_tensors.py" in line).split("--out ")[1].strip()
    assert any("race.py prepare .stage/race" in line and f"--images {folder} --runs 25" in line for line in lines)
    record = next(line for line in lines if "cifar10_speedrun.py" in line)
    assert f"cd '{folder[: -len('cifar10')]}hiverge'" in record
    bench = next(line for line in lines if "bench_step.py" in line)
    batch = from_preset().batch_size
    assert bench.endswith(
        f"--preset {DEFAULT_PRESET} --batches {batch} --graphs on --kernels auto --variant=--epochs 9 "
        "--variant=--brightness 0.0 --variant=--contrast 0.0 --variant=--epochs 9 --brightness 0.0 --contrast 0.0"
    ), bench
    assert any(line.endswith("bench/bench_augment.py --no-compile") for line in lines)
    report = next(line for line in lines if "race.py report" in line)
    assert "--jsonl bench/results/official.jsonl --call visit 13 --commit abc1234" in report


def test_levers_stage_without_its_candidate_fails_in_one_row_before_any_run(tmp_path):
    proc, out = visit(tmp_path, "levers", LEVERS_PRESET="no-such-stack")
    assert proc.returncode == 1
    assert "dry run:" not in proc.stdout
    assert table_steps(out, "levers") == ["levers"]
    assert "FAIL: race: no preset 'no-such-stack'" in (out / "levers-table.md").read_text()


def test_levers_stage_leaves_out_an_extra_the_candidate_already_is(tmp_path):
    """A candidate at 8.0 epochs has no "--epochs 8.0" variant: that extra is skipped, the rest runs."""
    proc, out = visit(tmp_path, "levers", LEVERS_PRESET="fast-muon")
    assert "--epochs 8.0" not in "\n".join(line for line in proc.stdout.splitlines() if line.startswith("dry run:"))
    assert any(name.startswith("fast-muon --epochs 8.0") for name in table_steps(out, "levers"))
    assert proc.returncode == 0, proc.stdout[-2000:]


def test_levers_stage_leaves_out_what_no_longer_fits_and_still_reports(tmp_path):
    """Past the record and the benches, the extra runs start only if they fit beside the table's
    40 s; the table runs whatever was left out."""
    proc, out = visit(tmp_path, "levers", LEVERS_PRESET="fast-muon9", STAGE_BUDGET_S="95")
    table = (out / "levers-table.md").read_text()
    for name in ("fast-muon9-batch-size-1536", "fast-muon9-epochs-8.0"):
        assert f"| {name} | left out: no time left | 0 |" in table, table
    assert table_steps(out, "levers")[-1] == "levers-table"
    assert "--batch-size 1536" not in "".join(line for line in proc.stdout.splitlines() if line.startswith("dry run:"))


def test_levers_stage_takes_the_levers_from_stdout_alone(tmp_path):
    """A warning the helper prints on stderr (a library's deprecation, say) is no lever."""
    python = tmp_path / "python"
    warn = '[ "$2" = levers ] && echo "SomeWarning: a library speaks" >&2'
    python.write_text(f'#!/bin/sh\n{warn}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    proc, out = visit(tmp_path, "levers", LEVERS_PRESET="fast-muon9", PYTHON=str(python))
    assert proc.returncode == 0, proc.stdout[-2000:]
    bench = next(line for line in proc.stdout.splitlines() if line.startswith("dry run:") and "bench_step.py" in line)
    assert "SomeWarning" not in bench and bench.count("--variant=") == 4, bench
