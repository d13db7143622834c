"""Every kind of kernel variant the launchers produce compiles for sm_70, sm_75, sm_80 and sm_90 (Volta
to Hopper) with Triton's own compiler, on a machine without a GPU, and none spills registers (issue
11, item 1; issue 69: the fused conv takes its small tiles below sm_80, where its large ones spilled).

The compile runs in a subprocess with ``TRITON_INTERPRET`` removed: these tests' own process has
the interpreter on (conftest.py), and the interpreter compiles nothing. The CI set is one of each
kind the presets launch (32 variants per arch, 128 compiles in all); ``python bench/kernel_registers.py
--set full`` compiles the whole sweep and writes bench/results/kernel_registers.md.

The compiling tests are marked slow (the four archs' compiles took 73 s of the fixture's 84 s, 17-19 s
each arch, the fused conv's six variants 24 s of it: 2 CPU cores, 2026-12-08, Triton 3.8.0); the parsing
and refusal tests are not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli import env_without_interpreter

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("triton.backends.nvidia", reason="Triton's CUDA backend (ptxas) is not installed")

from bench import kernel_registers as aot  # noqa: E402
from fastcifar.core.presets import DEFAULT_PRESET  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    env = env_without_interpreter(PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "bench/kernel_registers.py", "--set", "ci", "--arch", "70,75,80,90", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = out.stdout.strip().splitlines()
    assert lines, f"no output (exit {out.returncode}):\n{out.stderr[-3000:]}"
    return json.loads(lines[-1]), out


@pytest.mark.slow  # compiles every variant of the ci set for four GPU generations
def test_every_variant_compiles_to_a_cubin_for_every_arch(rows):
    rows, out = rows
    failed = [f"{r['arch']} {r['variant']} ({r['from']}): {r['error']}" for r in aot.problems(rows)[0]]
    assert not failed, "\n".join(failed)
    archs = {r["arch"] for r in rows}
    assert archs == {"sm_70", "sm_75", "sm_80", "sm_90"}
    kernels = {r["kernel"] for r in rows}
    assert kernels == {
        "_stats_kernel",
        "_stats_finalize_kernel",
        "_apply_kernel",
        "_bwd_reduce_kernel",
        "_bwd_finalize_kernel",
        "_bwd_dx_kernel",
        "_augment_kernel",
        "_cutout_kernel",
        "_conv_stats_kernel",
    }
    assert all(r["cubin_bytes"] > 0 and r["ptx_bytes"] > 0 and r["registers"] > 0 for r in rows)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.slow
def test_no_variant_spills(rows):
    rows, _ = rows
    spilled = [
        f"{r['arch']} {r['variant']} ({r['from']}): {r['registers']} registers, "
        f"{r['spill_store_bytes']} B spill stores, {r['spill_load_bytes']} B spill loads"
        for r in aot.problems(rows)[1]
    ]
    assert not spilled, "register spills:\n" + "\n".join(spilled)


@pytest.mark.slow
def test_the_recorder_sees_the_launchers_choices(rows):
    """The variants are what the launchers pick, not a hand-written list: the pooled `fast` block
    runs the pooling stats kernel, and eval mode's dx kernel is compiled without the batch terms."""
    rows, _ = rows
    variants = [r["variant"] for r in rows if r["arch"] == "sm_90"]
    assert any(v.startswith("_stats_kernel[") and "POOL=True,STATS=True" in v for v in variants), variants
    assert any(v.startswith("_stats_kernel[") and "POOL=True,STATS=False" in v for v in variants), variants
    assert any(v.startswith("_bwd_dx_kernel[") and "MODE=2" in v for v in variants), variants
    # the fused conv's tiles by generation: fp16 at 128 x 64 x 32 from sm_80, 64 x 32 x 16 below
    conv = {(r["arch"], "BLOCK_M=128" in r["variant"]) for r in rows if r["kernel"] == "_conv_stats_kernel"}
    assert ("sm_90", True) in conv and ("sm_80", True) in conv, conv
    assert ("sm_70", True) not in conv and ("sm_75", True) not in conv, conv
    # --brightness/--contrast: the augmentation's jitter variant, compiled without fp fusion as launched
    jitter = [v for v in variants if v.startswith("_augment_kernel[") and "JITTER=True" in v]
    assert jitter and all(v.endswith("; no fp fusion]") for v in jitter), jitter


@pytest.mark.slow  # over 2 s on 2 cores
def test_the_augment_kernel_compiles_without_64_bit_division_or_fma():
    """The default's augmentation (2000 of the 50,000 padded images, jitter on) compiled for sm_90:
    no 64-bit division or remainder in its PTX, and no fused multiply-add. Its first version had 20
    (five per element, by runtime divisors), a software routine each, and ran 6.5x slower than
    torch.compile of its reference (bench/results/visits/visit-12.md, 12e). Compiled in a subprocess,
    as above."""
    code = """
import re, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from bench import aot
from bench.kernel_registers import augment_call
(v,) = [x for x in aot.record(90, [augment_call(2000, 50000, 2, 0, torch.float16, True, jitter=True)])
        if x.kernel == "_augment_kernel"]
ptx = triton.compile(ASTSource(v.fn, v.signature, v.constexprs, v.attrs), target=GPUTarget("cuda", 90, 32),
                     options=dict(v.options)).asm["ptx"]
print(len(re.findall(r"\\b(?:div|rem)\\.[su]64", ptx)), len(re.findall(r"\\bld\\.global", ptx)),
      len(re.findall(r"\\bfma\\.", ptx)))
"""
    env = env_without_interpreter(PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    divisions, loads, fmas = (int(v) for v in out.stdout.split())
    assert loads > 0, "the PTX was not read"  # the counts below are of a real kernel's text
    assert divisions == 0, f"{divisions} 64-bit divisions or remainders in the augment kernel's PTX"
    # the jitter variant runs without fp fusion, so that it rounds as the reference (the interpreter
    # ignores the option: only the compiled code shows it)
    assert fmas == 0, f"{fmas} fused multiply-adds in the jitter variant's PTX"


def test_problems_are_failures_and_spills():
    ok = {"arch": "sm_90", "spill_store_bytes": 0, "spill_load_bytes": 0}
    spills = {"arch": "sm_90", "spill_store_bytes": 0, "spill_load_bytes": 4}
    failed = {"arch": "sm_80", "error": "CompilationError: x"}
    assert aot.problems([ok, spills, failed]) == ([failed], [spills])
    assert aot.problems([ok]) == ([], [])


def test_out_files_record_the_commit(tmp_path, monkeypatch, capsys):
    """The register table and its JSON lines carry bench/common.environment(): versions, date and the
    git commit, like every other file in bench/results/. The sweep is replaced: nothing compiles."""
    from bench.common import environment

    row = {
        "arch": "sm_90",
        "kernel": "_k",
        "variant": "_k[fp16]",
        "from": "call",
        "registers": 40,
        "stack_bytes": 0,
        "spill_store_bytes": 0,
        "spill_load_bytes": 0,
        "shared_bytes": 0,
        "compile_s": 0.1,
    }

    def sweep(archs, which, log, on_row):
        on_row(row)
        return [row]

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(aot, "sweep", sweep)
    out = tmp_path / "regs"
    assert aot.main(["--set", "ci", "--arch", "90", "--out", str(out)]) == 0
    commit = environment()["commit"]  # "" outside a git checkout
    (line,) = (tmp_path / "regs.jsonl").read_text().splitlines()
    rec = json.loads(line)
    assert {k: rec.get(k) for k in row} == row and rec["set"] == "ci", rec
    assert rec["commit"] == commit and all(rec.get(k) for k in ("triton", "torch", "date")), rec
    assert f"commit {commit or 'unknown'}" in (tmp_path / "regs.md").read_text()


def test_ptxas_report_parsing():
    from bench.aot import parse_ptxas

    log = (
        "ptxas info    : Function properties for k\n"
        "    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 72 registers, used 1 barriers, 16 bytes cumulative stack size\n"
    )
    assert parse_ptxas(log) == {"registers": 72, "stack_bytes": 16, "spill_store_bytes": 8, "spill_load_bytes": 12}
    with pytest.raises(ValueError, match="no register"):
        parse_ptxas("ptxas info    : 0 bytes gmem\n")


def test_refuses_to_run_under_the_interpreter(monkeypatch, capsys):
    from bench import kernel_registers as aot

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert aot.main(["--set", "ci"]) == 2
    assert "unset TRITON_INTERPRET" in capsys.readouterr().err


def traced(preset: str, kind: type, record) -> list:
    """record(module, its input) for every ``kind`` module of PRESET's network, in the order one
    forward reaches them, the batch written as the preset's (one GPU)."""
    import torch

    from fastcifar.core.config import from_preset
    from fastcifar.models.network import make_network
    from fastcifar.ops.norm_act_pool import NormActPool

    cfg = from_preset(preset)
    model = make_network(cfg, NormActPool).eval()
    seen = []
    for m in model.modules():
        if isinstance(m, kind):
            m.register_forward_hook(lambda m, args, out: seen.append((cfg.batch_size, *record(m, args[0]))))
    with torch.no_grad():
        model(torch.zeros(2, 3, 32, 32))
    return seen


@pytest.mark.parametrize(
    "preset,blocks,act",
    [
        ("fast", "FAST_BLOCKS", "gelu"),
        ("resnet9", "RESNET9_BLOCKS", "relu"),
        ("fast-muon320", "MUON320_BLOCKS", "gelu"),
        (DEFAULT_PRESET, "DEFAULT_BLOCKS", "gelu"),
    ],
)
def test_the_shape_lists_are_the_presets_blocks(preset, blocks, act):
    """aot's shape lists (what the compile sweep, the CUDA kernel tests and the kernel benchmark
    use) are each preset's real normalize blocks, each distinct one once in order: (batch,
    channels, side of the map entering the block, pool) read from the network itself, at the
    preset's batch on one GPU."""
    from fastcifar.ops.norm_act_pool import NormActPool

    seen = traced(preset, NormActPool, lambda m, x: (x.shape[1], x.shape[2], m.pool, m.act))
    distinct = list(dict.fromkeys(seen))  # ResNet-9's residual blocks repeat their layer's shape
    assert distinct == [(b, c, s, pool, act) for b, c, s, pool in getattr(aot, blocks)]


def test_the_conv_list_is_the_default_presets_convs():
    """DEFAULT_CONVS (the fused conv's compile sweep, CUDA tests and benchmark) are the default
    network's convs, in order: (batch, c_in, c_out, side of the map entering the conv, the pool of
    its normalize block), read from the network itself at the preset's batch on one GPU."""
    from fastcifar.ops.norm_act_pool import ConvBlock

    seen = traced(
        DEFAULT_PRESET, ConvBlock, lambda m, x: (m.conv.in_channels, m.conv.out_channels, x.shape[2], m.norm.pool)
    )
    assert seen == aot.DEFAULT_CONVS
