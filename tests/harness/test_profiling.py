"""NVTX markers, the profiler step window, and the two profiling scripts, on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import forkserver
import pytest
import torch
from cli import FAST_SHORT, ROOT, env

from fastcifar.core.options import parse_args
from fastcifar.parallel.distributed import DistContext
from fastcifar.run import profiling


def test_markers_off_cost_nothing():
    push, pop = profiling.markers(False)
    assert push("forward") is None and pop() is None
    data = [1, 2, 3]
    assert profiling.ranged(data, "data", push, pop) is data  # no wrapper at all
    if not torch.cuda.is_available():
        assert profiling.markers(True) == (push, pop), "without CUDA even --nvtx records nothing"


def test_ranged_brackets_each_next():
    events = []
    push, pop = (lambda name: events.append(("push", name))), (lambda: events.append(("pop",)))
    got = list(profiling.ranged(iter("ab"), "data", push, pop))
    assert got == ["a", "b"]
    assert events == [("push", "data"), ("pop",)] * 3  # the last push/pop brackets the StopIteration


def test_step_window_starts_and_stops_at_boundaries():
    calls = []
    w = profiling.StepWindow(
        "2:4", start=lambda: calls.append(("start", w.done)), stop=lambda: calls.append(("stop", w.done))
    )
    ticks = []
    cb = profiling.on_step(lambda: ticks.append(w.done))
    try:
        for _ in range(6):
            w.boundary()
    finally:
        profiling.remove_step_callback(cb)
    assert calls == [("start", 2), ("stop", 4)] and ticks == [1, 2, 3, 4, 5, 6]
    calls.clear()
    w0 = profiling.StepWindow("0:9", start=lambda: calls.append("start"), stop=lambda: calls.append("stop"))
    assert calls == ["start"]  # before the first step
    w0.close()
    w0.close()
    assert calls == ["start", "stop"]
    off = profiling.StepWindow("", start=lambda: calls.append("x"), stop=lambda: calls.append("x"))
    off.boundary()
    assert calls == ["start", "stop"]


@pytest.mark.parametrize("spec", ["3", "a:b", "5:5", "-1:2", "1:2:3"])
def test_bad_windows(spec):
    with pytest.raises(ValueError):
        profiling.parse_window(spec)


@pytest.mark.slow
def test_the_step_marks_its_phases(learnable_data, tmp_path, monkeypatch):
    from fastcifar import train as trainer

    events = []
    monkeypatch.setattr(
        profiling,
        "markers",
        lambda enabled: (
            ((lambda name: events.append(name)), (lambda: events.append("pop")))
            if enabled
            else (profiling._nothing, profiling._nothing)
        ),
    )
    cfg = parse_args(
        [
            "--data",
            str(learnable_data),
            "--out-dir",
            str(tmp_path),
            *FAST_SHORT,
            "--epochs",
            "1",
            "--warmup-epochs",
            "0.5",
            "--warmup-steps",
            "0",
            "--nvtx",
            "--profile-steps",
            "1:3",
        ]
    )
    trainer.train(cfg, DistContext(0, 1, 0, torch.device("cpu"), None))
    names = [e for e in events if e != "pop"]
    # before the clock, the estimate's one timed step (no warm-up steps here): its phases, no data range
    start = names.index("data")
    assert names[:start] == ["forward", "backward", "optimizer"]
    loop = names[start:]
    assert loop[:5] == ["data", "step", "forward", "backward", "optimizer"]
    assert (
        loop.count("step") == loop.count("forward") == loop.count("backward") == loop.count("optimizer") == 10
    )  # 1000 / 100
    assert events.count("pop") == len(names), "every range is closed"


@pytest.mark.slow
def test_profile_torch_end_to_end(learnable_data, tmp_path):
    out = tmp_path / "prof"
    proc = forkserver.run(
        [
            sys.executable,
            "scripts/profile_torch.py",
            "--skip",
            "2",
            "--steps",
            "2",
            "--top",
            "5",
            "--out",
            str(out),
            "--",
            "--data",
            str(learnable_data),
            *FAST_SHORT,
            "--epochs",
            "2",
            "--warmup-epochs",
            "0.5",
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "top 5 ops by self CPU time" in proc.stdout and "aten::" in proc.stdout
    trace = (out / "trace.json").read_text()
    assert trace.lstrip().startswith("{") and "ProfilerStep#" in trace
    too_short = forkserver.run(
        [
            sys.executable,
            "scripts/profile_torch.py",
            "--skip",
            "50",
            "--out",
            str(out),
            "--",
            "--data",
            str(learnable_data),
            *FAST_SHORT,
            "--epochs",
            "1",
            "--warmup-epochs",
            "0.5",
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert too_short.returncode == 2 and "the window needs 56" in too_short.stderr


@pytest.mark.slow
def test_profile_nsys_script_runs_the_trainer_with_a_capture_window(learnable_data, tmp_path):
    # A stand-in nsys: records its arguments, runs the profiled command without the profiler.
    fake = tmp_path / "bin" / "nsys"
    fake.parent.mkdir()
    fake.write_text(
        '#!/usr/bin/env bash\necho "nsys $*" >> "$NSYS_LOG"\n'
        'if [[ $1 == profile ]]; then shift; while [[ $1 == --* ]]; do shift; done; exec "$@"; fi\n'
    )
    fake.chmod(0o755)
    e = env()
    e.update(
        PATH=f"{fake.parent}{os.pathsep}{e['PATH']}",
        NSYS_LOG=str(tmp_path / "nsys.log"),
        PYTHON=sys.executable,
        OUT=str(tmp_path / "report"),
    )
    proc = subprocess.run(
        [
            "bash",
            "scripts/profile_nsys.sh",
            "2:4",
            "--",
            "--data",
            str(learnable_data),
            "--out-dir",
            str(tmp_path / "runs"),
            *FAST_SHORT,
            "--epochs",
            "1",
            "--warmup-epochs",
            "0.5",
        ],
        cwd=ROOT,
        env=e,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "nsys.log").read_text().splitlines()
    assert "--capture-range=cudaProfilerApi" in log[0] and "--nvtx --profile-steps 2:4" in log[0]
    assert log[1].startswith("nsys stats") and "nvtx_sum" in log[1]
    assert "run 1: test_acc" in proc.stdout
