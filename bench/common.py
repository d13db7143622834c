"""Shared benchmark helpers: CUDA check, timing, the device's copy bandwidth, tables, results files.

Every bench script measures the device-to-device copy bandwidth in the same run (the ceiling its
GB/s figures are compared with), prints a markdown table, and appends one JSON line per row to
``bench/results/<name>.jsonl`` with the device, versions, date and git commit.

``--smoke`` (see ``smoke_mode``) runs a script's whole logic on tiny shapes on the CPU under the
Triton interpreter, timed with perf_counter, writing nothing: it checks the script, not the speed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def smoke_mode(argv: Sequence[str] | None = None) -> bool:
    """True when --smoke is given; then TRITON_INTERPRET=1 is set (call this before importing triton)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--smoke" in argv:
        os.environ["TRITON_INTERPRET"] = "1"
        return True
    return False


def require_cuda(name: str) -> None:
    """Exit with one clear line and status 2 when there is no CUDA device: no figures are faked."""
    import torch

    if not torch.cuda.is_available():
        print(
            f"{name}: no CUDA device here, nothing measured (use --smoke to check the script on CPU)", file=sys.stderr
        )
        sys.exit(2)


def time_ms(fn: Callable[[], object], smoke: bool = False, grad_to_none=None, rep: int = 200) -> dict[str, float]:
    """Median, 20th and 80th percentile milliseconds of fn() (triton.testing.do_bench on CUDA, about
    ``rep`` ms of repetitions)."""
    if smoke:  # one call: the figure is meaningless on the CPU, and each call under the Triton
        # interpreter costs up to a second (three per figure took half the suite's bench-script time)
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        return {"median_ms": ms, "p20_ms": ms, "p80_ms": ms}
    import triton

    med, p20, p80 = triton.testing.do_bench(
        fn, warmup=25, rep=rep, grad_to_none=grad_to_none, quantiles=[0.5, 0.2, 0.8]
    )
    return {"median_ms": med, "p20_ms": p20, "p80_ms": p80}


def compile_static(fn: Callable) -> Callable:
    """``torch.compile(fn)`` for the shapes of the next row alone. Dynamo caches compiled code on
    ``fn``'s code object, which every ``torch.compile`` wrapper of ``fn`` shares: a new wrapper per
    row still recompiled at each new shape (dynamic shapes from the second on) and, past its
    recompile limit (8), ran the rest eagerly. A reset and static shapes give each row its own
    compile, for its shape alone (bench_bn_act_pool's compile_settings makes a recompile an error)."""
    import torch
    import torch._dynamo

    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def copy_bandwidth_gbs(nbytes: int = 1 << 30, smoke: bool = False) -> float:
    """Measured device-to-device copy bandwidth, GB/s counting the read and the write (2 x nbytes)."""
    import torch

    if smoke:
        nbytes = 1 << 20
    device = "cpu" if smoke else "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src), smoke)["median_ms"]
    return 2 * nbytes / (t * 1e-3) / 1e9


def git_commit(where: Path) -> str:
    """The short commit of the checkout at ``where``, with "+dirty" when tracked files differ from
    it (figures measured on uncommitted code must not be filed under the commit); "" outside git."""

    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=where, check=False).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        return commit + "+dirty" if commit and git("status", "--porcelain", "--untracked-files=no") else commit
    except OSError:
        return ""


def environment() -> dict[str, str]:
    """Device, versions, date and commit: the header of a results row."""
    import torch
    import triton

    commit = git_commit(Path(__file__).resolve().parent)
    return {
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": str(torch.version.cuda),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
    }


def print_header(title: str, env: dict[str, str], copy_gbs: float) -> None:
    print(f"## {title}\n")
    print(
        f"{env['device']} | torch {env['torch']} | triton {env['triton']} | CUDA {env['cuda']} | "
        f"{env['date']} | commit {env['commit']}"
    )
    print(f"measured device-to-device copy bandwidth: {copy_gbs:.0f} GB/s (read + write)\n")


def run_trainer(args: Sequence[str], out: Path, ranks: int = 1, name: str = "bench") -> Path:
    """One ``fastcifar.train`` run in a subprocess (under torchrun on ``ranks`` processes when there
    are several), writing under ``out``; returns the run's folder (summary.json and the rest). A
    failed run ends the bench with the tail of its stderr."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("WORLD_SIZE", None)  # a bench started under torchrun must not make its runs think they are ranks
    env.pop("RANK", None)
    launcher = [sys.executable, "-m", "fastcifar.train"]
    if ranks > 1:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(ranks),
            "-m",
            "fastcifar.train",
        ]
    proc = subprocess.run(
        [*launcher, *map(str, args), "--out-dir", str(out)], cwd=root, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        sys.exit(f"{name}: a run failed ({' '.join(map(str, args))}):\n{proc.stderr[-2000:]}")
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return run_dir


def add_index_argument(p: argparse.ArgumentParser, flag: str, count: int, help: str) -> None:
    """``flag``: one or more indices into a list of ``count`` shapes (default: all of them); an index
    out of range is refused by argparse with "indices 0..count-1, not I"."""

    def index(text: str) -> int:
        i = int(text)
        if not 0 <= i < count:
            raise argparse.ArgumentTypeError(f"indices 0..{count - 1}, not {i}")
        return i

    p.add_argument(flag, type=index, nargs="+", default=list(range(count)), help=help)


def best_setting(row: dict[str, object], settings: Sequence[str]) -> str | None:
    """A sweep's row: the setting of ``settings`` whose cell holds the least time (a cell holding an
    error string is not a time, so never the best), written to the row as "best" with "best vs base"
    (the "base" setting's time over the best's); None when no setting ran."""
    times = {k: row[k] for k in settings if isinstance(row.get(k), float)}
    if not times:
        return None
    best = min(times, key=times.get)
    row.update({"best": best, "best vs base": round(times.get("base", float("nan")) / times[best], 3)})
    return best


def markdown_table(rows: list[dict[str, object]], columns: Sequence[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def append_results(name: str, rows: list[dict[str, object]], env: dict[str, str], copy_gbs: float) -> Path:
    """Append one JSON line per row to bench/results/<name>.jsonl (environment fields on every line)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.jsonl"
    with path.open("a") as f:
        for r in rows:
            f.write(json.dumps({**env, "copy_gbs": round(copy_gbs, 1), **r}) + "\n")
    return path


def matmul_tflops(n: int = 8192, smoke: bool = False) -> float:
    """Measured dense fp16 matrix-product rate, TFLOP/s (random data: zeros run faster)."""
    import torch

    if smoke:
        n = 256
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.float16)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = time_ms(lambda: a @ b, smoke)["median_ms"]
    return 2 * n**3 / (t * 1e-3) / 1e12
