"""Benchmark the fused batchnorm + activation + pool kernels at the presets' shapes (fp16, channels-last).

    python bench/bench_bn_act_pool.py            # on a CUDA machine; --no-compile skips torch.compile
    python bench/bench_bn_act_pool.py --blocks 18 19 20 21 22 23   # the default preset's blocks only
    python bench/bench_bn_act_pool.py --smoke    # CPU check of this script (interpreter, tiny shapes);
                                                 # with --compile it runs torch.compile there too

Per block of the `resnet9` (ReLU, pool after, 512 images per GPU), `fast` (GELU, pool before BN on
31/15/7/3 maps, 1024 per GPU), `fast-muon320` (`fast`'s blocks at 2000, 320 channels wide) and default
`fast-jitter` (= `fast-muon9`'s: `fast`'s blocks at 2000) presets, as bench/kernel_registers.py lists
them: Triton vs eager PyTorch (``NormActPool``: cuDNN batchnorm + activation + max-pool) vs
``torch.compile`` of ``bn_act_pool_reference``; forward, backward (alone, through one retained
forward) and both; do_bench median with 20th/80th percentiles.

What is timed: on CUDA, replays of each direction captured as a CUDA graph (``timing`` = graph), as
the trainer runs these kernels inside a captured step. Timed as eager calls of a Python closure, the
Triton rows measured the CPU's launch cost, not the GPU (H100, c256 16x16 relu pool=after: fwd 0.132
ms, bwd 0.191 ms, both 0.820 ms; while a graphed train step took 4.16 ms with these kernels, 5.38 ms
with torch's). That eager, launch-inclusive median is kept as ``launch_ms``; median, percentiles,
GB/s and % copy are the graph replays'. On the CPU (--smoke) there are no graphs: every figure is the
eager one (``timing`` = launch).

GB/s are computed from the *minimal* bytes (read the input once, write the output once; backward:
read x and dy, write dx), and, for Triton, also from the bytes its kernels actually move (the table in
kernels/bn_act_pool.py's docstring), both beside the copy bandwidth measured in the same run. Then a
ResNet-9 forward+backward (no optimizer) with each norm, timed the same way. Rows are appended to
bench/results/bn_act_pool.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import smoke_mode

SMOKE = smoke_mode()

import torch
import torch.nn.functional as F
from torch import nn

from bench import kernel_registers
from bench.common import (
    add_index_argument,
    append_results,
    compile_static,
    copy_bandwidth_gbs,
    environment,
    markdown_table,
    print_header,
    require_cuda,
    time_ms,
)
from fastcifar.kernels.bn_act_pool import TritonNormActPool
from fastcifar.models.resnet9 import ResNet9
from fastcifar.ops.norm_act_pool import NormActPool, bn_act_pool_reference
from fastcifar.run.graphs import capture

CL = torch.channels_last
# (batch per GPU, channels, map side, activation, pool): every NormActPool of the two presets the
# trainer runs, from the same lists the AOT compile sweep and the CUDA kernel tests use
BLOCKS = kernel_registers.PRESET_BLOCKS
MODEL_BATCH = kernel_registers.RESNET9_BLOCKS[0][0]  # the ResNet-9 forward+backward at its preset's batch
# --smoke: one block of each kind (no pool, pool after, pool before on an odd map) at batch 2. The
# pool-after one is c512 8x8 (8 channel blocks), not c128 32x32: the interpreter runs a kernel's
# programs one by one, and that block took 49 of the test's 110 s on CI's 2 cores (this one ~12)
SMOKE_BLOCKS = [(2, c, side, act, pool) for _, c, side, act, pool in (BLOCKS[6], BLOCKS[10], BLOCKS[0])]
LAUNCH_REP_MS = 50  # do_bench repetitions of the eager launch_ms column, a side figure (graph replays: 200)
GRAPH_WARMUP = 3  # eager runs on the capture stream before each capture


def map_bytes(n, c, h, w, pool, elem=2):
    """(the block's input map, its output map) in bytes."""
    full = n * c * h * w * elem
    return full, n * c * (h // 2) * (w // 2) * elem if pool else full  # floor, as F.max_pool2d on odd maps


def kernel_bytes(n, c, h, w, pool, elem=2):
    """Bytes each of the Triton launchers' streaming kernels moves in one forward + backward
    (kernels/bn_act_pool.py's table; the two small stage-2 kernels move O(C) and count 0), with a
    full map counted whole: on odd maps, where the pool drops a row/column, that slightly over-counts."""
    full, out = map_bytes(n, c, h, w, pool, elem)
    if pool is None:
        return {
            "_stats_kernel": full,
            "_apply_kernel": 2 * full,
            "_bwd_reduce_kernel": 2 * full,
            "_bwd_dx_kernel": 3 * full,
        }
    if pool == "after":  # read x twice, write y; backward: read x and dy twice, write dx
        return {
            "_stats_kernel": full,
            "_apply_kernel": full + out,
            "_bwd_reduce_kernel": full + out,
            "_bwd_dx_kernel": 2 * full + out,
        }
    # "before": the stats kernel writes z (fp16) and an int8 argmax (half of z's bytes at fp16)
    return {
        "_stats_kernel": full + 1.5 * out,
        "_apply_kernel": 2 * out,
        "_bwd_reduce_kernel": 2 * out,
        "_bwd_dx_kernel": full + 2.5 * out,
    }


FORWARD_KERNELS = ("_stats_kernel", "_apply_kernel")  # the rest of kernel_bytes' keys run in backward


def traffic_bytes(n, c, h, w, pool, elem=2):
    """(minimal, triton) bytes for forward and backward: dicts keyed 'fwd', 'bwd', 'both'.
    The Triton bytes are the sums of ``kernel_bytes``."""
    full, out = map_bytes(n, c, h, w, pool, elem)
    minimal = {"fwd": full + out, "bwd": out + full + full}
    per_kernel = kernel_bytes(n, c, h, w, pool, elem)
    triton_b = {
        "fwd": sum(b for k, b in per_kernel.items() if k in FORWARD_KERNELS),
        "bwd": sum(b for k, b in per_kernel.items() if k not in FORWARD_KERNELS),
    }
    for d in (minimal, triton_b):
        d["both"] = d["fwd"] + d["bwd"]
    return minimal, triton_b


def block_impls(c, act, pool, device, compile_ref):
    eager = NormActPool(c, act=act, pool=pool).to(device)
    tri = TritonNormActPool(c, act=act, pool=pool).to(device)
    impls = {"eager": (eager, [eager.weight, eager.bias]), "triton": (tri, [tri.weight, tri.bias])}
    if compile_ref:
        mod = NormActPool(c, act=act, pool=pool).to(device)
        ref = compile_static(bn_act_pool_reference)  # its own compile per block: compile_static says why

        def compiled(x, m=mod):
            return ref(x, m.weight, m.bias, m.running_mean, m.running_var, True, m.momentum, m.eps, m.act, m.pool)

        impls["compile"] = (compiled, [mod.weight, mod.bias])
    return impls


def compile_settings(enabled: bool):
    """torch.compile settings while the blocks run (the ResNet-9 rows keep the defaults):
    - no donated buffers: "bwd" runs backward again and again through one retained forward
      (retain_graph=True, eagerly, or once into a graph), which a backward compiled with donated
      buffers refuses on torch 2.11 ("This backward function was compiled with non-empty donated
      buffers which requires create_graph=False and retain_graph=False"). Donation lets a backward
      reuse its saved buffers' memory: it saves memory, not traffic, so the timing is the same.
    - error_on_recompile: each block compiles once (block_impls); a recompile within one would time
      something else than that compile, so its row reports the error instead."""
    stack = contextlib.ExitStack()
    if enabled:
        import torch._dynamo.config
        import torch._functorch.config

        stack.enter_context(torch._dynamo.config.patch(error_on_recompile=True))
        if hasattr(torch._functorch.config, "donated_buffer"):  # torch >= 2.6
            stack.enter_context(torch._functorch.config.patch(donated_buffer=False))
    return stack


def direction_bodies(fn, x, dy, inputs):
    """What "fwd", "bwd" and "both" run: the forward; the backward alone, through the latest forward
    (retained); forward and backward. Gradients by autograd.grad, none accumulated into a .grad."""
    held = {}

    def fwd():
        held["y"] = fn(x)

    def bwd():
        torch.autograd.grad(held["y"], inputs, dy, retain_graph=True)

    def both():
        torch.autograd.grad(fn(x), inputs, dy)

    return {"fwd": fwd, "bwd": bwd, "both": both}


def graph_timings(bodies, stream):
    """CUDA only. Capture each body as a CUDA graph on ``stream``, in order, as the trainer captures
    its step (``fastcifar.run.graphs.capture``: GRAPH_WARMUP eager runs first), and time the graphs'
    replays. One stream for all: autograd runs a backward op on its forward op's stream, and "bwd"
    backprops through the forward captured as "fwd"."""
    graphs = {}
    for name, body in bodies.items():
        graphs[name] = capture(body, GRAPH_WARMUP, stream=stream)
        graphs[name].replay()  # a capture records, it runs nothing: give a later body real inputs
    torch.cuda.synchronize()
    return {name: time_ms(g.replay) for name, g in graphs.items()}


def timed(bodies, graphs: bool):
    """(timings, launch timings, timing label, error) of each body: graph replays when ``graphs``
    (CUDA), else the eager calls themselves. An eager failure raises; a capture failure is returned
    as the error, with the eager figures (the whole message on stderr).

    On CUDA the eager runs go on the stream the graphs are then captured on: the leaves' autograd
    nodes (the input's and the weights' gradient accumulators) are made at the first forward and
    live on in the output "fwd" holds, and made on the default stream they tie a captured backward
    to it. With the eager runs on the default stream, the eager c64 31x31 pool-before block (the
    first measured) failed its capture in all three runs that timed graph replays, with torch's
    warning that an AccumulateGrad node's stream did not match; on the capture stream it captures
    (bench/results/visits/visit-7.md, 7c)."""
    stream = torch.cuda.Stream() if graphs and torch.cuda.is_available() else None  # None: the tests' stand-in
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # None: no stream change
        for body in bodies.values() if not SMOKE else ():  # --smoke: the one timed call is the warm-up too
            body()  # warm up / compile
        launch = {name: time_ms(body, SMOKE, rep=LAUNCH_REP_MS) for name, body in bodies.items()}
    if stream is not None:
        torch.cuda.current_stream().wait_stream(stream)  # later work on the default stream sees it done
    if not graphs:
        return launch, launch, "launch", None
    try:
        return graph_timings(bodies, stream), launch, "graph", None
    except Exception as e:
        traceback.print_exc()
        return {}, launch, "graph", f"CUDA graph capture: {_error(e)}"


def direction_rows(base: dict, fn, x, dy, params, graphs: bool, figures) -> list[dict]:
    """One row per direction (fwd, bwd, both) of ``fn`` on ``x`` (``timed``): ``base``, the timing
    cells, and ``figures(direction, median_ms)``'s cells (rates, checks; an "error" cell among them
    marks the row failed). A path that fails is one row with its error, not the end of the bench."""
    try:
        timings, launch, timing, error = timed(direction_bodies(fn, x, dy, [x, *params]), graphs)
    except Exception as e:
        return [{**base, "error": _error(e)}]
    rows = []
    for direction in launch:
        row = {**base, "dir": direction, **_timing_cells(timings.get(direction), launch[direction], timing)}
        t = timings.get(direction)
        rows.append({**row, "error": error} if t is None else {**row, **figures(direction, t["median_ms"])})
    return rows


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e)[:120]}"


def _timing_cells(t, launch, timing):
    """A row's timing cells: median and percentiles (of what ``timing`` names), and launch_ms."""
    return {
        "timing": timing,
        **{k: round(v, 4) for k, v in (t or {}).items()},
        "launch_ms": round(launch["median_ms"], 4),
    }


def bench_blocks(device, blocks, compile_ref, copy_gbs, graphs, record=None):
    """One row per block x impl x direction. ``record`` gets each block's rows as soon as they are
    measured: a stage cut off at its time limit keeps the blocks it finished."""
    rows = []
    for n, c, hw, act, pool in blocks:
        first = len(rows)
        block = f"c{c} {hw}x{hw} {act} pool={pool}"
        x = torch.randn(n, c, hw, hw, device=device).half().contiguous(memory_format=CL).requires_grad_()
        oh = hw // 2 if pool else hw
        dy = torch.randn(n, c, oh, oh, device=device).half().contiguous(memory_format=CL)
        minimal, tri_bytes = traffic_bytes(n, c, hw, hw, pool)
        for name, (fn, params) in block_impls(c, act, pool, device, compile_ref).items():

            def figures(direction, ms, name=name, minimal=minimal, tri_bytes=tri_bytes):
                gbs = minimal[direction] / (ms * 1e-3) / 1e9
                cells = {"GB/s (min bytes)": round(gbs, 1), "% copy": round(100 * gbs / copy_gbs, 1)}
                if name == "triton":
                    own = tri_bytes[direction] / (ms * 1e-3) / 1e9
                    cells.update({"GB/s (own bytes)": round(own, 1), "% copy (own)": round(100 * own / copy_gbs, 1)})
                return cells

            rows += direction_rows({"batch": n, "block": block, "impl": name}, fn, x, dy, params, graphs, figures)
        print(f"{block}: {len(rows) - first} rows", flush=True)
        if record is not None:
            record(rows[first:])
    return rows


def _resnet9(norm, device, widths):
    model = ResNet9(norm=norm, widths=widths).to(device).to(memory_format=CL)
    for m in model.modules():  # fp16 convs and classifier; norms keep fp32 parameters and statistics
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            m.half()
    return model


def bench_model(device, batches, widths, compile_model, graphs):
    rows = []
    for n in batches:
        x = torch.randn(n, 3, 32, 32, device=device).half().contiguous(memory_format=CL)
        labels = torch.randint(0, 10, (n,), device=device)
        variants = {
            "eager": _resnet9(NormActPool, device, widths),
            "triton": _resnet9(TritonNormActPool, device, widths),
        }
        if compile_model:
            variants["compile"] = torch.compile(_resnet9(NormActPool, device, widths))
        for name, model in variants.items():
            params = list(model.parameters())

            def step(model=model, params=params, x=x, labels=labels):
                torch.autograd.grad(F.cross_entropy(model(x).float(), labels), params)

            try:
                timings, launch, timing, error = timed({"step": step}, graphs)
            except Exception as e:
                rows.append({"batch": n, "impl": name, "error": _error(e)})
                continue
            row = {"batch": n, "impl": name, **_timing_cells(timings.get("step"), launch["step"], timing)}
            rows.append({**row, "error": error} if error else row)
    return rows


def add_blocks_argument(p: argparse.ArgumentParser) -> None:
    """--blocks: indices into ``BLOCKS``, here and in the sweep."""
    add_index_argument(
        p, "--blocks", len(BLOCKS), "indices into bench/kernel_registers.py's PRESET_BLOCKS (default: all)"
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_blocks_argument(p)
    p.add_argument("--no-compile", action="store_true", help="leave torch.compile of the reference out")
    p.add_argument(
        "--compile",
        action="store_true",
        help="--smoke: run torch.compile of the blocks on the CPU too "
        "(the whole network's is left to the GPU: a plain torch.compile, 15 s more on 2 CPU cores)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny CPU run of the script's logic; writes nothing")
    return p.parse_args(argv)


def main():
    args = parse_args()
    if not SMOKE:
        require_cuda("bench_bn_act_pool")
    device = "cpu" if SMOKE else "cuda"
    # --smoke leaves torch.compile out unless asked (--compile): on the CPU it needs a C++ compiler
    compile_ref = args.compile if SMOKE else not args.no_compile
    graphs = device == "cuda"  # no CUDA graphs on the CPU: the eager calls are timed there
    blocks = SMOKE_BLOCKS if SMOKE else [BLOCKS[i] for i in args.blocks]
    widths = (8, 16, 16, 32) if SMOKE else (64, 128, 256, 512)
    env = environment()
    copy_gbs = copy_bandwidth_gbs(smoke=SMOKE)
    print_header(
        "bn_act_pool: fused batchnorm + ReLU/GELU (+ 2x2 max-pool), fp16 channels-last, training mode", env, copy_gbs
    )

    def record(block_rows):  # appended block by block (see bench_blocks); the ResNet-9 rows at the end
        append_results("bn_act_pool", [dict(r, section="block") for r in block_rows], env, copy_gbs)

    with compile_settings(compile_ref):
        rows = bench_blocks(device, blocks, compile_ref, copy_gbs, graphs, record=None if SMOKE else record)
    print(
        markdown_table(
            rows,
            [
                "batch",
                "block",
                "impl",
                "dir",
                "timing",
                "median_ms",
                "p20_ms",
                "p80_ms",
                "launch_ms",
                "GB/s (min bytes)",
                "% copy",
                "GB/s (own bytes)",
                "% copy (own)",
                "error",
            ],
        )
    )
    model_rows = bench_model(device, (2,) if SMOKE else (MODEL_BATCH,), widths, compile_ref and not SMOKE, graphs)
    print("\n### ResNet-9 forward + backward (no optimizer), fp16 activations\n")
    print(
        markdown_table(model_rows, ["batch", "impl", "timing", "median_ms", "p20_ms", "p80_ms", "launch_ms", "error"])
    )
    if SMOKE:
        print("\n(smoke run on CPU under the Triton interpreter: timings meaningless, nothing written)")
        return
    path = append_results("bn_act_pool", [dict(r, section="resnet9") for r in model_rows], env, copy_gbs)
    print(f"\nappended {len(rows) + len(model_rows)} rows to {path}")


if __name__ == "__main__":
    main()
