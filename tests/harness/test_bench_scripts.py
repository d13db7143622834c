"""The benchmark scripts run end to end in their CPU forms (figures meaningless, nothing written),
so a change to the trainer's API cannot silently break them."""

from __future__ import annotations

import shutil
import sys

import forkserver
import pytest
import torch
from cli import ROOT, bench_results, env
from conftest import tar_folder, write_image_folder
from script_modules import load_script

pytestmark = pytest.mark.slow  # each runs a benchmark script end to end in a subprocess


def run_bench(script: str, *args, timeout: float = 300):
    """bench/SCRIPT ARGS in its own process (forked where it can be), its output captured."""
    return forkserver.run(
        [sys.executable, str(ROOT / "bench" / script), *map(str, args)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "script, args, expect",
    [
        ("bench_step.py", ["--smoke"], "| batch | kernels | graphs | step_ms"),
        ("bench_augment.py", ["--smoke"], "| impl | dir | median_ms | floor_ms |"),  # the floor beside it
        ("bench_muon.py", ["--smoke"], "| layout | filters | stacks | aten_ops | compute_ops | kernels |"),
        ("bench_conv_stats.py", ["--smoke"], "| batch | conv | impl | dir | timing | median_ms"),
        ("sweep_bn_act_pool.py", ["--smoke"], "| block | base | w2 | best |"),
        ("sweep_conv_stats.py", ["--smoke"], "| batch | conv | cudnn+triton | base | w4 | best | best vs base |"),
        ("sweep_bn_act_pool.py", ["--smoke", "--per-kernel"], "| block | setting | kernel | us |"),
        # 2 gloo ranks: the default preset's network (FastNet, narrowed), DDP and two bucket caps
        (
            "bench_allreduce.py",
            ["--preset", "fast-jitter", "--widths", "8,16,16", "--batch", "4", "--bucket-mb", "0.001,25"]
            + ["--steps", "2", "--rounds", "1", "--warmup", "1", "--no-save"],
            "fast-jitter (fastnet) widths 8,16,16",
        ),
        # the two that launch the trainer (bench.common.run_trainer) and append their own rows
        ("bench_compress.py", ["--smoke"], "smoke run: figures meaningless, nothing written"),
        ("bench_sparse.py", ["--smoke"], "smoke run: figures meaningless, nothing written"),
        ("bench_train.py", ["--smoke"], "smoke run: figures meaningless, nothing written"),
        ("bench_sweep.py", ["--smoke"], "smoke run: figures meaningless, nothing written"),
    ],
)
def test_bench_script_runs(script, args, expect):
    before = bench_results()
    proc = run_bench(script, *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert expect in proc.stdout
    assert bench_results() == before, "a CPU form must not write results"
    cells = [c.strip().lower() for line in proc.stdout.splitlines() if line.startswith("|") for c in line.split("|")]
    assert "nan" not in cells and "inf" not in cells


def test_loader_bench_times_each_loader_and_the_start_up_decode(tmp_path):
    """bench_loader.py's CPU form on a JPEG archive of 400 images (the shared copy's 60,000 took the
    PIL decode alone 12 s): both tables, every loader, nothing written."""
    folder, _ = write_image_folder(tmp_path / "jpegs", n_train=300, n_test=100, fmt="JPEG")
    archive = tar_folder(folder, tmp_path / "jpegs.tar.gz", "cifar10")
    args = ["--data", archive, "--images", "256", "--epochs", "1", "--batches", "64", "--no-record"]
    before = bench_results()
    proc = run_bench("bench_loader.py", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert bench_results() == before, "a CPU form must not write results"
    assert "read 400 JPEGs from" in proc.stdout and "Start-up: decode the whole JPEG set (400 images)" in proc.stdout
    epochs, startup = _tables(proc.stdout)
    loaders = {"dali", "torch"} if "DALI unavailable" not in proc.stdout else {"torch"}
    assert {r["loader"] for r in epochs} == loaders and all(r["batch/rank"] == "64" for r in epochs)
    assert {r["decoder"] for r in startup} == {"torch (PIL)"} | ({"dali"} & loaders)
    cells = [c.lower() for r in epochs + startup for c in r.values()]
    assert "nan" not in cells and "inf" not in cells


def test_gpu_bench_without_gpu_refuses_in_one_line():
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run_bench("bench_step.py", timeout=120)
    assert proc.returncode == 2
    assert "no CUDA device here" in proc.stderr and proc.stderr.count("\n") == 1


def _tables(stdout):
    """The markdown tables of a bench's output: one list of {column: cell} rows each."""
    tables, header = [], None
    for line in stdout.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            tables.append([])
        elif not all(set(c) <= {"-", ":"} for c in cells):  # not the separator row (aligned too)
            tables[-1].append(dict(zip(header, cells, strict=True)))
    return tables


def test_bn_act_pool_bench_on_cpu_labels_its_timing():
    """On the CPU there are no CUDA graphs: every row says its figures are eager launches
    ("launch"), with launch_ms beside them; torch.compile (--compile, when a C++ compiler is here)
    compiles each block once, so no row of it fails on a recompile (the whole network's compile is
    left to the GPU on --smoke: a plain torch.compile, 15 s of the suite)."""
    compiles = shutil.which("g++") is not None or shutil.which("clang++") is not None
    args = ["--smoke", "--compile"] if compiles else ["--smoke"]
    before = bench_results()
    proc = run_bench("bench_bn_act_pool.py", *args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert bench_results() == before, "a CPU form must not write results"
    assert "measured device-to-device copy bandwidth" in proc.stdout
    blocks, model = _tables(proc.stdout)
    impls = {"eager", "triton", "compile"} if compiles else {"eager", "triton"}
    assert {r["impl"] for r in blocks} == impls and {r["impl"] for r in model} == {"eager", "triton"}
    assert len(blocks) == 3 * len(impls) * 3  # 3 smoke blocks x impls x fwd/bwd/both
    for r in blocks + model:
        assert r["error"] == "", r
        assert r["timing"] == "launch", r
        assert r["launch_ms"] != "" and r["launch_ms"] == r["median_ms"], r  # one and the same figure
        assert all(c.lower() not in ("nan", "inf") for c in r.values()), r
    assert all(r["GB/s (min bytes)"] != "" for r in blocks)


def test_bn_act_pool_bench_times_the_blocks_it_is_given(capsys):
    """--blocks picks from bench/kernel_registers.py's PRESET_BLOCKS (the GPU visit's kernels stage times the
    default preset's, 18-23); an index past the list is one line and exit 2."""
    from fastcifar.core.config import from_preset

    bench = load_script("bench/bench_bn_act_pool.py")
    assert bench.parse_args([]).blocks == list(range(len(bench.BLOCKS)))
    chosen = [bench.BLOCKS[i] for i in bench.parse_args(["--blocks", "18", "19", "20", "21", "22", "23"]).blocks]
    default = from_preset()
    assert {(b, c) for b, c, *_ in chosen} == {(default.batch_size, w) for w in default.widths}
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(["--blocks", str(len(bench.BLOCKS))])
    assert stop.value.code == 2 and "--blocks: indices 0..23" in capsys.readouterr().err


def test_bn_act_pool_directions_take_gradients_without_accumulating():
    """bwd runs again and again through the latest forward (retained); no direction leaves a .grad
    (autograd.grad: no accumulation into x.grad, which a conv's output would not have)."""
    import torch

    from fastcifar.ops.norm_act_pool import NormActPool

    bench = load_script("bench/bench_bn_act_pool.py")
    bench.SMOKE = True  # as --smoke sets it: CPU timing (perf_counter), not do_bench
    norm = NormActPool(8, act="relu", pool="after")
    x = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last).requires_grad_()
    dy = torch.randn(2, 8, 3, 3).contiguous(memory_format=torch.channels_last)
    bodies = bench.direction_bodies(norm, x, dy, [x, norm.weight, norm.bias])
    assert list(bodies) == ["fwd", "bwd", "both"]
    for name in ("fwd", "bwd", "bwd", "both", "fwd", "bwd"):
        bodies[name]()
    assert x.grad is None and norm.weight.grad is None and norm.bias.grad is None
    timings, launch, timing, error = bench.timed(bodies, graphs=False)
    assert timing == "launch" and error is None and timings is launch and set(launch) == {"fwd", "bwd", "both"}


def test_bn_act_pool_compile_settings_scoped():
    """While the blocks run: a recompile is an error (each block compiles once), and no donated
    buffers (they forbid the retained backward "bwd" times, on torch 2.11); afterwards the defaults."""
    import torch._dynamo.config
    import torch._functorch.config

    bench = load_script("bench/bench_bn_act_pool.py")
    dynamo, functorch = torch._dynamo.config, torch._functorch.config
    before = (dynamo.error_on_recompile, getattr(functorch, "donated_buffer", None))
    with bench.compile_settings(False):
        assert (dynamo.error_on_recompile, getattr(functorch, "donated_buffer", None)) == before
    with bench.compile_settings(True):
        assert dynamo.error_on_recompile is True
        if hasattr(functorch, "donated_buffer"):
            assert functorch.donated_buffer is False
    assert (dynamo.error_on_recompile, getattr(functorch, "donated_buffer", None)) == before


@pytest.mark.parametrize("capture_fails", [False, True])
def test_bn_act_pool_graph_rows(monkeypatch, capture_fails):
    """With graphs (CUDA), median, percentiles, GB/s and % copy are the graph replays' and launch_ms
    the eager figure; an impl that cannot be captured gets the error in its rows, no GB/s. The
    capture itself needs CUDA: a stand-in returns fixed figures (or raises) here."""
    bench = load_script("bench/bench_bn_act_pool.py")
    bench.SMOKE = True  # the eager launch_ms by perf_counter, as --smoke times it
    all_impls = bench.block_impls
    monkeypatch.setattr(bench, "block_impls", lambda *a: {"eager": all_impls(*a)["eager"]})  # no interpreter

    def fake_graph_timings(bodies, stream):
        if capture_fails:
            raise RuntimeError("operation not permitted when stream is capturing")
        return {name: {"median_ms": 2.0, "p20_ms": 1.5, "p80_ms": 2.5} for name in bodies}

    monkeypatch.setattr(bench, "graph_timings", fake_graph_timings)
    n, c, hw, pool = 2, 8, 6, "after"
    rows = bench.bench_blocks("cpu", [(n, c, hw, "relu", pool)], False, 100.0, graphs=True)
    assert [r["dir"] for r in rows] == ["fwd", "bwd", "both"]
    minimal, _ = bench.traffic_bytes(n, c, hw, hw, pool)
    for r in rows:
        assert r["timing"] == "graph" and r["launch_ms"] > 0
        if capture_fails:
            assert r["error"] == "CUDA graph capture: RuntimeError: operation not permitted when stream is capturing"
            assert "median_ms" not in r and "GB/s (min bytes)" not in r
        else:
            assert "error" not in r
            assert (r["median_ms"], r["p20_ms"], r["p80_ms"]) == (2.0, 1.5, 2.5)
            assert r["GB/s (min bytes)"] == round(minimal[r["dir"]] / 2e-3 / 1e9, 1)
            assert r["% copy"] == round(100 * r["GB/s (min bytes)"] / 100.0, 1)


def test_bn_act_pool_records_each_block_as_it_finishes(monkeypatch):
    """The kernels stage may be cut off at its time limit: each block's rows reach ``record`` as soon
    as that block is measured, not all at the end."""
    bench = load_script("bench/bench_bn_act_pool.py")
    bench.SMOKE = True
    all_impls = bench.block_impls
    monkeypatch.setattr(bench, "block_impls", lambda *a: {"eager": all_impls(*a)["eager"]})  # no interpreter
    recorded = []
    blocks = [(2, 8, 6, "relu", "after"), (2, 8, 4, "relu", None)]
    rows = bench.bench_blocks(
        "cpu",
        blocks,
        False,
        100.0,
        graphs=False,
        record=lambda block_rows: recorded.append([r["block"] for r in block_rows]),
    )
    assert recorded == [["c8 6x6 relu pool=after"] * 3, ["c8 4x4 relu pool=None"] * 3]  # one call per block
    assert sum(map(len, recorded)) == len(rows)


def test_sweep_settings_reach_every_pool_place_and_base_restores_the_table():
    """sweep_bn_act_pool times a setting by swapping kernels/bn_act_pool.LAUNCH: one Launch goes to
    every pool place, "base" is the module's own per-place table, and it must come back after."""
    from fastcifar.kernels import bn_act_pool as bn

    sweep = load_script("bench/sweep_bn_act_pool.py")
    table = dict(bn.LAUNCH)
    try:
        sweep.apply(sweep.SETTINGS["w2"])
        assert set(bn.LAUNCH) == {None, "before", "after"} and set(bn.LAUNCH.values()) == {sweep.SETTINGS["w2"]}
        sweep.apply(sweep.SETTINGS["base"])
        assert bn.LAUNCH == table
    finally:
        bn.LAUNCH.update(table)


@pytest.mark.parametrize("pool", [None, "before", "after"])
def test_kernel_bytes_names_every_streaming_kernel_the_launchers_run(pool, monkeypatch):
    """The per-kernel split divides each kernel's bytes by its time: the names kernel_bytes counts
    must be the kernels a training forward + backward launches, less the two O(C) stage-2 ones, and
    their sums what traffic_bytes reports (the % copy of the sweep and of the benchmark)."""
    from fastcifar.kernels import bn_act_pool as bap

    launched = []

    class Recorder:  # stands in for a @triton.jit kernel: ``kernel[grid](...)`` records its name
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(self.name)

    for name in [n for n in vars(bap) if n.startswith("_") and n.endswith("_kernel")]:
        monkeypatch.setattr(bap, name, Recorder(name))
    x = torch.randn(4, 24, 6, 6).half().contiguous(memory_format=torch.channels_last)
    ones = lambda: torch.ones(24)  # noqa: E731
    y, saved = bap.bn_act_pool_forward(x, ones(), ones(), ones(), ones(), True, 0.1, 1e-5, "relu", pool)
    bap.bn_act_pool_backward(torch.empty_like(y), saved, ones(), ones(), x.shape, True, "relu", pool)
    bench = load_script("bench/bench_bn_act_pool.py")
    per_kernel = bench.kernel_bytes(4, 24, 6, 6, pool)
    assert set(per_kernel) == set(launched) - {"_stats_finalize_kernel", "_bwd_finalize_kernel"}
    assert len(launched) == 6
    _, own = bench.traffic_bytes(4, 24, 6, 6, pool)
    assert own["both"] == sum(per_kernel.values())
    assert own["fwd"] == sum(per_kernel[k] for k in bench.FORWARD_KERNELS)


def test_per_kernel_rows_rate_the_streaming_kernels_against_copy():
    sweep = load_script("bench/sweep_bn_act_pool.py")
    block = (2, 8, 6, "relu", None)
    full = 2 * 8 * 6 * 6 * 2  # bytes of one fp16 map
    rows = sweep.kernel_rows(block, "base", {"_apply_kernel": 2.0, "_stats_finalize_kernel": 1.5}, 100.0)
    apply_row, finalize_row = rows
    assert apply_row["kernel"] == "_apply_kernel" and apply_row["us"] == 2.0
    assert apply_row["GB/s (own bytes)"] == round(2 * full / 2e-6 / 1e9, 1)  # reads x, writes y
    assert apply_row["% copy (own)"] == round(100 * apply_row["GB/s (own bytes)"] / 100.0, 1)
    assert finalize_row == {
        "block": "2 c8 6x6 relu pool=None",
        "setting": "base",
        "kernel": "_stats_finalize_kernel",
        "us": 1.5,
    }


def test_conv_sweep_never_names_a_wrong_setting_best(monkeypatch):
    """A setting whose output is off is an error cell in its row, not a time, so never the best; the
    module's launch setting is restored after every setting, also one that fails."""
    sweep = load_script("bench/sweep_conv_stats.py")
    base = sweep.cs.LAUNCH
    real = sweep.cs.conv_stats_forward

    def off_under_w4(x, weight, training, pool=None):
        out, idx, partials = real(x, weight, training, pool)
        if sweep.cs.LAUNCH == sweep.SETTINGS["w4"]:
            out = out + 1.0  # a wrong kernel under this setting only
        return out, idx, partials

    monkeypatch.setattr(sweep.cs, "conv_stats_forward", off_under_w4)
    monkeypatch.setattr(sweep, "forward_ms", lambda block, x, device: 1.0)
    row = sweep.sweep_conv((2, 8, 8, 5, None), ["base", "w4"], "cpu")
    assert row["base"] == 1.0 and row["w4"].startswith("output off by"), row
    assert row["best"] == "base" and row["best / cudnn+triton"] == 1.0
    assert sweep.cs.LAUNCH == base
    assert all(s.block_m % 4 == 0 and s.block_k >= 16 and s.block_n >= 16 for s in sweep.SETTINGS.values())
