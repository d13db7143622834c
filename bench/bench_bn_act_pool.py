"""Benchmark the fused batchnorm + activation + pool kernels at the presets' shapes (fp16, channels-last).

    python bench/bench_bn_act_pool.py            # on a CUDA machine; --no-compile skips torch.compile
    python bench/bench_bn_act_pool.py --smoke    # CPU check of this script (interpreter, tiny shapes)

Per block of the `resnet9` (ReLU, pool after, 512 images per GPU) and `fast` (GELU, pool before BN on
31/15/7/3 maps, 1024 per GPU) presets, as kernels/aot.py lists them: Triton vs eager PyTorch
(``NormActPool``: cuDNN batchnorm + activation + max-pool) vs ``torch.compile`` of ``bn_act_pool_reference``;
forward, backward and both; do_bench median with 20th/80th percentiles. GB/s are computed from the
*minimal* bytes (read the input once, write the output once; backward: read x and dy, write dx), and,
for Triton, also from the bytes its kernels actually move (the table in kernels/bn_act_pool.py's
docstring), both beside the copy bandwidth measured in the same run. Then a ResNet-9 forward+backward
(no optimizer) with each norm. Rows are appended to bench/results/bn_act_pool.jsonl.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import smoke_mode  # noqa: E402

SMOKE = smoke_mode()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from bench.common import (append_results, copy_bandwidth_gbs, environment, markdown_table,  # noqa: E402
                          print_header, require_cuda, time_ms)
from fastcifar.model import NormActPool, ResNet9  # noqa: E402
from fastcifar.kernels import aot  # noqa: E402
from fastcifar.kernels.bn_act_pool import TritonNormActPool, bn_act_pool_reference  # noqa: E402

CL = torch.channels_last
# (batch per GPU, channels, map side, activation, pool): every NormActPool of the two presets the
# trainer runs, from the same lists the AOT compile sweep and the CUDA kernel tests use
BLOCKS = ([(n, c, side, "relu", pool) for n, c, side, pool in aot.RESNET9_BLOCKS]
          + [(n, c, side, "gelu", pool) for n, c, side, pool in aot.FAST_BLOCKS])
MODEL_BATCH = aot.RESNET9_BLOCKS[0][0]  # the ResNet-9 forward+backward at its preset's batch
# --smoke: one block of each kind (no pool, pool after, pool before on an odd map) at batch 2
SMOKE_BLOCKS = [(2, c, side, act, pool) for _, c, side, act, pool in (BLOCKS[0], BLOCKS[1], BLOCKS[6])]


def traffic_bytes(n, c, h, w, pool, elem=2):
    """(minimal, triton) bytes for forward and backward: dicts keyed 'fwd', 'bwd', 'both'.
    The Triton bytes are kernels/bn_act_pool.py's table with its 4P (a full map) counted as the
    whole map: on odd maps, where the pool drops a row/column, that slightly over-counts."""
    full = n * c * h * w * elem
    out = n * c * (h // 2) * (w // 2) * elem if pool else full  # floor, as F.max_pool2d on odd maps
    minimal = {"fwd": full + out, "bwd": out + full + full}
    if pool is None:
        triton_b = {"fwd": 3 * full, "bwd": 5 * full}
    elif pool == "after":  # read x twice, write y; backward: read x and dy twice, write dx
        triton_b = {"fwd": 2 * full + out, "bwd": 3 * full + 2 * out}
    else:  # z (fp16) and an int8 argmax (half of z's bytes at fp16)
        triton_b = {"fwd": full + 3.5 * out, "bwd": full + 4.5 * out}
    for d in (minimal, triton_b):
        d["both"] = d["fwd"] + d["bwd"]
    return minimal, triton_b


def block_impls(c, act, pool, device, compile_ref):
    eager = NormActPool(c, act=act, pool=pool).to(device)
    tri = TritonNormActPool(c, act=act, pool=pool).to(device)
    impls = {"eager": (eager, [eager.weight, eager.bias]), "triton": (tri, [tri.weight, tri.bias])}
    if compile_ref:
        mod = NormActPool(c, act=act, pool=pool).to(device)
        ref = torch.compile(bn_act_pool_reference)

        def compiled(x, m=mod):
            return ref(x, m.weight, m.bias, m.running_mean, m.running_var, True, m.momentum, m.eps, m.act, m.pool)

        impls["compile"] = (compiled, [mod.weight, mod.bias])
    return impls


def bench_blocks(device, blocks, compile_ref, copy_gbs):
    rows = []
    for n, c, hw, act, pool in blocks:
        block = f"c{c} {hw}x{hw} {act} pool={pool}"
        x = torch.randn(n, c, hw, hw, device=device).half().contiguous(memory_format=CL).requires_grad_()
        oh = hw // 2 if pool else hw
        dy = torch.randn(n, c, oh, oh, device=device).half().contiguous(memory_format=CL)
        minimal, tri_bytes = traffic_bytes(n, c, hw, hw, pool)
        for name, (fn, params) in block_impls(c, act, pool, device, compile_ref).items():
            to_none = [x, *params]
            try:
                y = fn(x)
                y.backward(dy, retain_graph=True)  # warm up / compile both directions
                timings = {
                    "fwd": time_ms(lambda: fn(x), SMOKE),
                    "bwd": time_ms(lambda: y.backward(dy, retain_graph=True), SMOKE, grad_to_none=to_none),
                    "both": time_ms(lambda: fn(x).backward(dy), SMOKE, grad_to_none=to_none),
                }
            except Exception as e:  # a baseline that fails is reported, not fatal
                rows.append({"batch": n, "block": block, "impl": name,
                             "error": f"{type(e).__name__}: {str(e)[:120]}"})
                continue
            for direction, t in timings.items():
                gbs = minimal[direction] / (t["median_ms"] * 1e-3) / 1e9
                row = {"batch": n, "block": block, "impl": name, "dir": direction,
                       **{k: round(v, 4) for k, v in t.items()}, "GB/s (min bytes)": round(gbs, 1),
                       "% copy": round(100 * gbs / copy_gbs, 1)}
                if name == "triton":
                    own = tri_bytes[direction] / (t["median_ms"] * 1e-3) / 1e9
                    row["GB/s (own bytes)"] = round(own, 1)
                    row["% copy (own)"] = round(100 * own / copy_gbs, 1)
                rows.append(row)
    return rows


def _resnet9(norm, device, widths):
    model = ResNet9(norm=norm, widths=widths).to(device).to(memory_format=CL)
    for m in model.modules():  # fp16 convs and classifier; norms keep fp32 parameters and statistics
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            m.half()
    return model


def bench_model(device, batches, widths, compile_model):
    rows = []
    for n in batches:
        x = torch.randn(n, 3, 32, 32, device=device).half().contiguous(memory_format=CL)
        labels = torch.randint(0, 10, (n,), device=device)
        variants = {"eager": _resnet9(NormActPool, device, widths), "triton": _resnet9(TritonNormActPool, device, widths)}
        if compile_model:
            variants["compile"] = torch.compile(_resnet9(NormActPool, device, widths))
        for name, model in variants.items():
            def step(model=model):
                F.cross_entropy(model(x).float(), labels).backward()

            try:
                step()
                t = time_ms(step, SMOKE, grad_to_none=list(model.parameters()))
            except Exception as e:
                rows.append({"batch": n, "impl": name, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                continue
            rows.append({"batch": n, "impl": name, **{k: round(v, 4) for k, v in t.items()}})
    return rows


def main():
    args = sys.argv[1:]
    if not SMOKE:
        require_cuda("bench_bn_act_pool")
    device = "cpu" if SMOKE else "cuda"
    compile_ref = not SMOKE and "--no-compile" not in args
    blocks = SMOKE_BLOCKS if SMOKE else BLOCKS
    widths = (8, 16, 16, 32) if SMOKE else (64, 128, 256, 512)
    env = environment()
    copy_gbs = copy_bandwidth_gbs(smoke=SMOKE)
    print_header("bn_act_pool: fused batchnorm + ReLU/GELU (+ 2x2 max-pool), fp16 channels-last, training mode",
                 env, copy_gbs)
    rows = bench_blocks(device, blocks, compile_ref, copy_gbs)
    print(markdown_table(rows, ["batch", "block", "impl", "dir", "median_ms", "p20_ms", "p80_ms",
                                "GB/s (min bytes)", "% copy", "GB/s (own bytes)", "% copy (own)", "error"]))
    model_rows = bench_model(device, (2,) if SMOKE else (MODEL_BATCH,), widths, compile_ref)
    print("\n### ResNet-9 forward + backward (no optimizer), fp16 activations\n")
    print(markdown_table(model_rows, ["batch", "impl", "median_ms", "p20_ms", "p80_ms", "error"]))
    if SMOKE:
        print("\n(smoke run on CPU under the Triton interpreter: timings meaningless, nothing written)")
        return
    path = append_results("bn_act_pool", [dict(r, section="block") for r in rows]
                          + [dict(r, section="resnet9") for r in model_rows], env, copy_gbs)
    print(f"\nappended {len(rows) + len(model_rows)} rows to {path}")


if __name__ == "__main__":
    main()
