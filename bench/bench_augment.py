"""Benchmark the fused augmentation (crop + flip + normalize + cutout, uint8 -> fp16) and cutout.

    python bench/bench_augment.py            # on a CUDA machine; --no-compile skips torch.compile
    python bench/bench_augment.py --smoke    # CPU check of this script (interpreter, tiny shapes)

Augment: 512 and 256 images per GPU gathered by index from the whole padded CIFAR-10 training set
(50000 x 40 x 40 x 3 uint8, random bytes: speed does not depend on content) on the device. Triton
``augment`` vs eager ``augment_reference(data[index], ...)`` vs ``torch.compile`` of the same; also
Triton with ``draw_params`` included (the real per-step cost). Forward only: uint8 has no gradient.
Cutout: on the (B, 3, 32, 32) fp16 input batch, forward, backward and both. GB/s from the minimal
bytes (read each input byte once, write each output once) beside the measured copy bandwidth. Rows are
appended to bench/results/augment.jsonl.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import smoke_mode  # noqa: E402

SMOKE = smoke_mode()

import torch  # noqa: E402

from bench.common import (append_results, copy_bandwidth_gbs, environment, markdown_table,  # noqa: E402
                          print_header, require_cuda, time_ms)
from fastcifar.augment import CIFAR10_MEAN, CIFAR10_STD, draw_params  # noqa: E402
from fastcifar.kernels.augment import augment, augment_indexed_reference, channel_constants  # noqa: E402
from fastcifar.kernels.cutout import cutout, cutout_reference  # noqa: E402

CL = torch.channels_last
PAD, CUTOUT, SIZE = 4, 12, 32
BATCHES = (512, 256)


def _row(op, n, impl, direction, t, nbytes, copy_gbs):
    gbs = nbytes / (t["median_ms"] * 1e-3) / 1e9
    return {"op": op, "batch": n, "impl": impl, "dir": direction, **{k: round(v, 4) for k, v in t.items()},
            "GB/s (min bytes)": round(gbs, 1), "% copy": round(100 * gbs / copy_gbs, 1)}


def bench_augment(device, batches, num_images, compile_ref, copy_gbs):
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    data = torch.randint(0, 256, (num_images, SIZE + 2 * PAD, SIZE + 2 * PAD, 3), dtype=torch.uint8,
                         device=device, generator=gen)
    # Triton gets device tensors (no per-call host copy); the references take the tuples, as they are
    # called in the torch path (fastcifar.augment.normalize builds its tensors from them on every call)
    mean = channel_constants(CIFAR10_MEAN, 3, device)
    std = channel_constants(CIFAR10_STD, 3, device)
    for n in batches:
        index = torch.randperm(num_images, device=device, generator=gen)[:n]
        params = draw_params(n, PAD, CUTOUT, gen, device)
        nbytes = n * SIZE * SIZE * 3 * (1 + 2)  # uint8 in, fp16 out
        impls = {
            "triton": lambda: augment(data, params, CUTOUT, mean, std, torch.float16, SIZE, index),
            "triton+draw": lambda: augment(data, draw_params(n, PAD, CUTOUT, gen, device), CUTOUT, mean, std,
                                           torch.float16, SIZE, index),
            "eager": lambda: augment_indexed_reference(data, params, CUTOUT, CIFAR10_MEAN, CIFAR10_STD, torch.float16, SIZE,
                                                    index),
        }
        if compile_ref:
            ref = torch.compile(augment_indexed_reference)
            impls["compile"] = lambda: ref(data, params, CUTOUT, CIFAR10_MEAN, CIFAR10_STD, torch.float16, SIZE, index)
        for name, fn in impls.items():
            try:
                fn()
                rows.append(_row("augment", n, name, "fwd", time_ms(fn, SMOKE), nbytes, copy_gbs))
            except Exception as e:
                rows.append({"op": "augment", "batch": n, "impl": name, "error": f"{type(e).__name__}: {str(e)[:120]}"})
    return rows


def bench_cutout(device, batches, compile_ref, copy_gbs):
    rows = []
    gen = torch.Generator(device=device).manual_seed(1)
    for n in batches:
        x = torch.randn(n, 3, SIZE, SIZE, device=device, generator=gen).half().contiguous(memory_format=CL)
        x.requires_grad_()
        dy = torch.randn(n, 3, SIZE, SIZE, device=device, generator=gen).half().contiguous(memory_format=CL)
        params = draw_params(n, PAD, CUTOUT, gen, device)
        nbytes = x.numel() * 2 * 2  # read + write fp16, each direction
        impls = {"triton": cutout, "eager": cutout_reference}
        if compile_ref:
            impls["compile"] = torch.compile(cutout_reference)
        for name, op in impls.items():
            def fwd(op=op):
                return op(x, params.cy, params.cx, CUTOUT)

            try:
                y = fwd()
                y.backward(dy, retain_graph=True)
                t = {"fwd": time_ms(fwd, SMOKE),
                     "bwd": time_ms(lambda: y.backward(dy, retain_graph=True), SMOKE, grad_to_none=[x]),
                     "both": time_ms(lambda: fwd().backward(dy), SMOKE, grad_to_none=[x])}
            except Exception as e:
                rows.append({"op": "cutout", "batch": n, "impl": name, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                continue
            for direction, tt in t.items():
                rows.append(_row("cutout", n, name, direction, tt, nbytes * (2 if direction == "both" else 1), copy_gbs))
    return rows


def main():
    if not SMOKE:
        require_cuda("bench_augment")
    device = "cpu" if SMOKE else "cuda"
    compile_ref = not SMOKE and "--no-compile" not in sys.argv[1:]
    batches = (4,) if SMOKE else BATCHES
    env = environment()
    copy_gbs = copy_bandwidth_gbs(smoke=SMOKE)
    print_header("augment: crop + flip + normalize + cutout (uint8 -> fp16), and cutout alone", env, copy_gbs)
    rows = bench_augment(device, batches, 16 if SMOKE else 50000, compile_ref, copy_gbs)
    rows += bench_cutout(device, batches, compile_ref, copy_gbs)
    print(markdown_table(rows, ["op", "batch", "impl", "dir", "median_ms", "p20_ms", "p80_ms",
                                "GB/s (min bytes)", "% copy", "error"]))
    if SMOKE:
        print("\n(smoke run on CPU under the Triton interpreter: timings meaningless, nothing written)")
        return
    print(f"\nappended {len(rows)} rows to {append_results('augment', rows, env, copy_gbs)}")


if __name__ == "__main__":
    main()
