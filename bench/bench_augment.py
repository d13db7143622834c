"""Benchmark the fused augmentation (crop + flip + normalize + jitter + cutout, uint8 -> fp16) and cutout.

    python bench/bench_augment.py            # on a CUDA machine; --no-compile skips torch.compile
    python bench/bench_augment.py --smoke    # CPU check of this script (interpreter, tiny shapes)

Augment, at each preset's batch, crop padding and cutout (`fast`: 1024, pad 2, no cutout; `resnet9`:
512, pad 4, cutout 8; the default: 2000, pad 2, no cutout, also with the record script's
brightness/contrast jitter, ``--brightness 0.14 --contrast 0.13``, two float loads per element more): a batch gathered
by index from the whole padded CIFAR-10 training set (50000
images, random bytes: speed does not depend on content) on the device. Triton ``augment`` vs eager
``augment_reference(data[index], ...)`` vs ``torch.compile`` of the same, each given the device
mean/std tensors the loader holds. The parameters are not drawn here: the loaders draw a whole
epoch's on the host once (``loader.epoch_plan``), not per step. Forward only: uint8 has no gradient.
Cutout (the presets with one): on the (B, 3, 32, 32) fp16 input batch, forward, backward and both.
GB/s from the minimal bytes (read each input byte once, write each output once) beside the measured
copy bandwidth, and the device's floor for the row: those bytes at the copy bandwidth (``floor_ms``;
the default's batch: 18.4 MB, about 0.006 ms at the 3.0 TB/s an H100 copied at in augment.jsonl). Rows are appended to
bench/results/augment.jsonl.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import smoke_mode

SMOKE = smoke_mode()

import torch

from bench.common import (
    append_results,
    compile_static,
    copy_bandwidth_gbs,
    environment,
    markdown_table,
    print_header,
    require_cuda,
    time_ms,
)
from bench.cutout import cutout
from fastcifar.core.config import from_preset
from fastcifar.core.presets import DEFAULT_PRESET
from fastcifar.kernels.augment import augment, channel_constants
from fastcifar.ops.augment import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    AugmentSpec,
    augment_indexed_reference,
    cutout_reference,
    draw_params,
)

CL = torch.channels_last
SIZE = 32


def bench_spec(cfg, **changes) -> AugmentSpec:
    """A preset's augmentation as the kernel sees it: random flips (alternating ones need the
    data-set index; the kernel reads one flip per image either way), no jitter unless asked."""
    return dataclasses.replace(
        AugmentSpec.from_config(cfg), **{"flip_mode": "random", "brightness": 0.0, "contrast": 0.0, **changes}
    )


# (preset, batch on one GPU, augmentation): what each preset's loader augments per step
JITTER = {"brightness": 0.14, "contrast": 0.13}
PRESETS = [
    (name, cfg.batch_size, bench_spec(cfg))
    for name, cfg in ((name, from_preset(name)) for name in ("fast", "resnet9", DEFAULT_PRESET))
]
PRESETS.append(
    (
        f"{DEFAULT_PRESET} --brightness 0.14 --contrast 0.13",
        PRESETS[-1][1],
        bench_spec(from_preset(DEFAULT_PRESET), **JITTER),
    )
)
SMOKE_BATCH = 4


def _row(op, preset, n, impl, direction, t, nbytes, copy_gbs):
    gbs = nbytes / (t["median_ms"] * 1e-3) / 1e9
    return {
        "op": op,
        "preset": preset,
        "batch": n,
        "impl": impl,
        "dir": direction,
        **{k: round(v, 4) for k, v in t.items()},
        "GB/s (min bytes)": round(gbs, 1),
        "% copy": round(100 * gbs / copy_gbs, 1),
        "floor_ms": round(floor_ms(nbytes, copy_gbs), 4),
    }


def floor_ms(nbytes: int, copy_gbs: float) -> float:
    """The least time ``nbytes`` of traffic takes on this device: moved at its measured copy rate."""
    return nbytes / (copy_gbs * 1e9) * 1e3


def bench_augment(device, presets, num_images, compile_ref, copy_gbs):
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    # device tensors for every path, made once, as the loader holds them (TorchLoader.mean/std and
    # TritonAugment's buffers): no per-call host-to-device copy in any row
    mean = channel_constants(CIFAR10_MEAN, 3, device)
    std = channel_constants(CIFAR10_STD, 3, device)
    for preset, n, spec in presets:
        pad = spec.crop_pad
        data = torch.randint(
            0, 256, (num_images, SIZE + 2 * pad, SIZE + 2 * pad, 3), dtype=torch.uint8, device=device, generator=gen
        )
        index = torch.randperm(num_images, device=device, generator=gen)[:n]
        params = draw_params(n, spec, gen, device)
        nbytes = n * SIZE * SIZE * 3 * (1 + 2)  # uint8 in, fp16 out
        impls = {
            "triton": functools.partial(augment, data, params, spec, mean, std, torch.float16, SIZE, index),
            "eager": functools.partial(
                augment_indexed_reference, data, params, spec, mean, std, torch.float16, SIZE, index
            ),
        }
        if compile_ref:
            ref = compile_static(augment_indexed_reference)
            impls["compile"] = functools.partial(ref, data, params, spec, mean, std, torch.float16, SIZE, index)
        for name, fn in impls.items():
            try:
                fn()
                rows.append(_row("augment", preset, n, name, "fwd", time_ms(fn, SMOKE), nbytes, copy_gbs))
            except Exception as e:
                rows.append(
                    {
                        "op": "augment",
                        "preset": preset,
                        "batch": n,
                        "impl": name,
                        "error": f"{type(e).__name__}: {str(e)[:120]}",
                    }
                )
    return rows


def bench_cutout(device, presets, compile_ref, copy_gbs):
    rows = []
    gen = torch.Generator(device=device).manual_seed(1)
    for preset, n, spec in presets:
        side = spec.cutout
        if not side:  # this preset has no cutout
            continue
        x = torch.randn(n, 3, SIZE, SIZE, device=device, generator=gen).half().contiguous(memory_format=CL)
        x.requires_grad_()
        dy = torch.randn(n, 3, SIZE, SIZE, device=device, generator=gen).half().contiguous(memory_format=CL)
        params = draw_params(n, spec, gen, device)
        nbytes = x.numel() * 2 * 2  # read + write fp16, each direction
        impls = {"triton": cutout, "eager": cutout_reference}
        if compile_ref:
            impls["compile"] = compile_static(cutout_reference)
        for name, op in impls.items():

            def fwd(op=op, x=x, params=params, side=side):
                return op(x, params.cy, params.cx, side)

            try:
                y = fwd()
                y.backward(dy, retain_graph=True)
                t = {
                    "fwd": time_ms(fwd, SMOKE),
                    "bwd": time_ms(lambda y=y, dy=dy: y.backward(dy, retain_graph=True), SMOKE, grad_to_none=[x]),
                    "both": time_ms(lambda fwd=fwd, dy=dy: fwd().backward(dy), SMOKE, grad_to_none=[x]),
                }
            except Exception as e:
                rows.append(
                    {
                        "op": "cutout",
                        "preset": preset,
                        "batch": n,
                        "impl": name,
                        "error": f"{type(e).__name__}: {str(e)[:120]}",
                    }
                )
                continue
            for direction, tt in t.items():
                rows.append(
                    _row("cutout", preset, n, name, direction, tt, nbytes * (2 if direction == "both" else 1), copy_gbs)
                )
    return rows


def main():
    if not SMOKE:
        require_cuda("bench_augment")
    device = "cpu" if SMOKE else "cuda"
    compile_ref = not SMOKE and "--no-compile" not in sys.argv[1:]
    presets = [(p, SMOKE_BATCH, spec) for p, _, spec in PRESETS] if SMOKE else PRESETS
    env = environment()
    copy_gbs = copy_bandwidth_gbs(smoke=SMOKE)
    print_header("augment: crop + flip + normalize + jitter + cutout (uint8 -> fp16), and cutout alone", env, copy_gbs)
    rows = bench_augment(device, presets, 16 if SMOKE else 50000, compile_ref, copy_gbs)
    rows += bench_cutout(device, presets, compile_ref, copy_gbs)
    print(
        markdown_table(
            rows,
            [
                "op",
                "preset",
                "batch",
                "impl",
                "dir",
                "median_ms",
                "floor_ms",
                "p20_ms",
                "p80_ms",
                "GB/s (min bytes)",
                "% copy",
                "error",
            ],
        )
    )
    if SMOKE:
        print("\n(smoke run on CPU under the Triton interpreter: timings meaningless, nothing written)")
        return
    print(f"\nappended {len(rows)} rows to {append_results('augment', rows, env, copy_gbs)}")


if __name__ == "__main__":
    main()
