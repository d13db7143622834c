"""Every NVIDIA GPU from Volta to Blackwell (issue 69): the preflight before any CUDA work
(``fastcifar.core.gpu``, called by ``pick_device``) and the choices that follow from the device's
compute capability, on a machine without a GPU: the capability, name, SM count and torch's arch
list are mocked (tests/helpers/gpus.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from cli import env_without_interpreter
from gpus import CU130_ARCHS, TORCH_2_10_ARCHS, fake_gpus

from fastcifar import train as trainer
from fastcifar.core import gpu
from fastcifar.core.config import Config, ConfigError, from_preset, validate
from fastcifar.parallel.distributed import DistContext, pick_device
from fastcifar.run import optim
from fastcifar.run.optim import NS_COEFFICIENTS, newton_schulz

ROOT = Path(__file__).resolve().parents[2]
V100 = (7, 0)
VOLTA_LINE = "pip install -e '.[volta]'"


# --- the preflight --------------------------------------------------------------------------------


def test_capability_7_0_under_the_cu130_torch_is_one_line_and_exit_2(tmp_path):
    """The trainer as a user starts it, in a subprocess whose torch sees one V100 and the cu130
    wheel's arch list (a sitecustomize mocks both before anything imports): one line naming the GPU,
    its capability, the installed torch and the Volta install line; exit 2; no traceback; nothing written."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        textwrap.dedent(
            """
            import json, os, torch
            capability, archs = json.loads(os.environ["FAKE_GPU"])
            torch.cuda.is_available = lambda: True
            torch.cuda.device_count = lambda: 1
            torch.cuda.get_device_capability = lambda device=None: tuple(capability)
            torch.cuda.get_device_name = lambda device=None: "Tesla V100-SXM2-16GB"
            torch.cuda.get_arch_list = lambda: archs
            """
        )
    )
    env = env_without_interpreter(
        PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), FAKE_GPU=json.dumps([V100, CU130_ARCHS])
    )
    for device in ("auto", "cuda"):
        proc = subprocess.run(
            [sys.executable, "-m", "fastcifar", "train", "--data", str(tmp_path / "data"), "--device", device]
            + ["--out-dir", str(tmp_path / "runs")],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line == (
            "fastcifar: error: GPU 0 (Tesla V100-SXM2-16GB, compute capability 7.0) cannot run "
            f"torch {torch.__version__}" + (f" (CUDA {torch.version.cuda})" if torch.version.cuda else "") + ", "
            "which is built for sm_75 sm_80 sm_86 sm_90 sm_100 sm_120: "
            f"install the Volta (V100) line of README's Install table: {VOLTA_LINE}"
        )
        assert not (tmp_path / "runs").exists() and not (tmp_path / "data").exists()


@pytest.mark.parametrize(
    "capability,archs",
    [(V100, TORCH_2_10_ARCHS), ((9, 0), CU130_ARCHS), ((12, 0), CU130_ARCHS), ((9, 0), TORCH_2_10_ARCHS)],
)
def test_capability_with_code_in_the_arch_list_passes_the_preflight(monkeypatch, capability, archs):
    chosen = fake_gpus(monkeypatch, 8, capability, archs)
    assert pick_device("cuda", 3, Config()) == torch.device("cuda", 3) and chosen == [3]


def test_capability_check_leaves_a_rocm_build_alone(monkeypatch):
    """A ROCm torch lists gfx targets, not sm_XY: the arch check cannot judge it and must not refuse."""
    chosen = fake_gpus(monkeypatch, 2, (9, 0), ["gfx90a", "gfx942"])
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    assert pick_device("cuda", 1, Config()) == torch.device("cuda", 1) and chosen == [1]
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.raises(ConfigError, match="cannot run"):  # the same list read as a CUDA build's: refused
        pick_device("cuda", 1, Config())


def test_capability_7_0_under_the_cu130_torch_picks_no_device(monkeypatch):
    chosen = fake_gpus(monkeypatch, 8, V100, CU130_ARCHS)
    with pytest.raises(ConfigError, match=r"GPU 5 \(Tesla V100-SXM2-16GB, compute capability 7\.0\) cannot run"):
        pick_device("auto", 5)
    assert chosen == []


@pytest.mark.parametrize(
    "entry,capability,runs",
    [
        ("sm_80", (8, 6), True),  # a cubin runs on later minors of its major
        ("sm_86", (8, 0), False),
        ("sm_80", (9, 0), False),  # ... but not on another major
        ("sm_120", (12, 0), True),
        ("sm_100", (10, 3), True),
        ("sm_90a", (9, 0), True),  # arch-specific: that capability only
        ("sm_100a", (10, 3), False),
        ("compute_70", (7, 5), True),  # PTX: the driver compiles it for any later capability
        ("compute_70", (12, 0), True),
        ("compute_80", (7, 5), False),
        ("sm_7x", (7, 0), False),
    ],
)
def test_capability_against_each_kind_of_arch_entry(entry, capability, runs):
    assert gpu.runs_on(entry, capability) is runs


def test_capability_checked_against_a_ptx_entry_that_jits_forward(monkeypatch):
    fake_gpus(monkeypatch, 1, (12, 1), ["sm_80", "sm_90", "compute_90"])
    assert pick_device("cuda", 0) == torch.device("cuda", 0)
    fake_gpus(monkeypatch, 1, V100, ["sm_80", "sm_90", "compute_90"])
    with pytest.raises(ConfigError, match="built for sm_80 sm_90 compute_90"):
        pick_device("cuda", 0)


def test_capability_below_volta_gets_no_install_line(monkeypatch):
    fake_gpus(monkeypatch, 1, (6, 1), CU130_ARCHS)
    with pytest.raises(ConfigError, match=r"cover compute capability 7\.0 \(Volta\) and newer; use --device cpu$"):
        pick_device("cuda", 0)


def test_capability_unknown_when_cuda_is_off_but_nvidia_smi_lists_a_gpu(monkeypatch, capsys):
    """A driver too old for this torch's CUDA: CUDA reads as unavailable. --device auto says so in
    one line before it trains on the CPU; --device cuda is refused with that line; without a GPU in
    nvidia-smi's list auto is silent, as before."""
    fake_gpus(monkeypatch, 0, driver=["GPU 0: Tesla V100-SXM2-16GB", "GPU 1: Tesla V100-SXM2-16GB"])
    assert pick_device("auto", 0) == torch.device("cpu")
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("fastcifar: note: nvidia-smi lists GPU 0: Tesla V100-SXM2-16GB and 1 more, but torch ")
    assert line.endswith("update the NVIDIA driver; training on the CPU")
    assert pick_device("auto", 1) == torch.device("cpu") and capsys.readouterr().err == ""  # local rank 0 says it
    with pytest.raises(ConfigError, match=r"^--device cuda was asked for, but nvidia-smi lists GPU 0: Tesla V100"):
        pick_device("cuda", 0)
    fake_gpus(monkeypatch, 0)
    assert pick_device("auto", 0) == torch.device("cpu") and capsys.readouterr().err == ""


def test_capability_nvidia_smi_is_read_and_bounded(tmp_path, monkeypatch):
    """The real ``driver_gpus``: nvidia-smi found on PATH, its GPU lines without UUIDs; one that
    hangs is given up after the timeout; none on PATH, none listed."""
    sleep = shutil.which("sleep")  # before PATH holds only the fake tool
    tool = tmp_path / "nvidia-smi"
    tool.write_text('#!/bin/sh\necho "GPU 0: Tesla V100-SXM2-16GB (UUID: GPU-3f2a)"\necho "  MIG 1g.5gb"\n')
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu.driver_gpus() == ["GPU 0: Tesla V100-SXM2-16GB"]
    tool.write_text(f'#!/bin/sh\necho "GPU 0: Tesla V100-SXM2-16GB"\nexec {sleep} 30\n')  # waited for: the line
    assert gpu.driver_gpus(timeout_s=0.5) == []
    tool.unlink()
    assert gpu.driver_gpus() == []


@pytest.mark.parametrize(
    "capability,archs,builds,refused",
    [
        (V100, TORCH_2_10_ARCHS, [("nvidia-dali-cuda130", 13)], "cannot run nvidia-dali-cuda130"),
        (V100, TORCH_2_10_ARCHS, [("nvidia-dali-cuda120", 12)], None),
        ((9, 0), CU130_ARCHS, [("nvidia-dali-cuda130", 13)], None),
        ((7, 5), CU130_ARCHS, [("nvidia-dali-cuda130", 13)], None),
        ((9, 0), CU130_ARCHS, [("nvidia-dali-cuda120", 12), ("nvidia-dali-cuda130", 13)], "2 DALI builds"),
    ],
)
def test_capability_against_the_dali_build(monkeypatch, capability, archs, builds, refused):
    """--loader dali: the installed DALI build must hold code for the GPU (CUDA 13's start at
    sm_75), and only one may be installed; the torch loader never asks."""
    chosen = fake_gpus(monkeypatch, 1, capability, archs)
    monkeypatch.setattr(gpu, "dali_builds", lambda: builds)
    if refused:
        with pytest.raises(ConfigError, match=f"^--loader dali: .*{refused}") as err:
            pick_device("cuda", 0, Config(loader="dali"))
        assert "\n" not in str(err.value) and chosen == []
    else:
        assert pick_device("cuda", 0, Config(loader="dali")) == torch.device("cuda", 0)
    assert pick_device("cuda", 0, Config(loader="torch")) == torch.device("cuda", 0)


def test_capability_dali_builds_read_from_the_package_metadata(monkeypatch):
    class Dist:
        def __init__(self, name):
            self.metadata = {"Name": name}

    names = ["torch", "nvidia_dali_cuda130", "nvidia-dali-cuda120", "nvidia-dali-tf-plugin-cuda120"]
    monkeypatch.setattr(gpu.importlib.metadata, "distributions", lambda: [Dist(n) for n in names])
    assert gpu.dali_builds() == [("nvidia-dali-cuda120", 12), ("nvidia-dali-cuda130", 13)]


@pytest.mark.parametrize("capability,refused", [(V100, True), ((7, 5), True), ((8, 0), False), ((9, 0), False)])
def test_capability_below_8_0_refuses_compress_bf16(monkeypatch, capability, refused):
    fake_gpus(monkeypatch, 1, capability, TORCH_2_10_ARCHS)
    if refused:
        with pytest.raises(ConfigError, match=r"^--compress bf16: GPU 0 .* has no bf16 arithmetic .* --compress fp16$"):
            pick_device("cuda", 0, Config(compress="bf16"))
    else:
        assert pick_device("cuda", 0, Config(compress="bf16")) == torch.device("cuda", 0)
    assert pick_device("cuda", 0, Config(compress="fp16")) == torch.device("cuda", 0)


# --- the dtype policy -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "capability,dtype",
    [(V100, torch.float16), ((7, 5), torch.float16), ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)]
    + [((12, 0), torch.bfloat16)],
)
def test_capability_decides_the_newton_schulz_dtype(monkeypatch, capability, dtype):
    fake_gpus(monkeypatch, 1, capability, TORCH_2_10_ARCHS)
    assert gpu.newton_schulz_dtype(torch.device("cuda", 0)) == dtype
    assert gpu.newton_schulz_dtype(torch.device("cpu")) == torch.float32


def cast_first(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """newton_schulz as it was before the policy: cast to ``dtype``, then scale to unit norm in it."""
    a, b, c = NS_COEFFICIENTS
    x = g.unsqueeze(0).to(dtype)
    x = x / (torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x[0]


def test_capability_below_8_0_runs_fp16_newton_schulz_closer_to_fp32_than_bf16():
    """The choice below 8.0 (no bf16 tensor cores): fp16 with the norm scaling before the cast stays
    within the bf16 path's distance of the fp32 iteration (about 10x closer: 10 mantissa bits to 7)
    at every scale of gradient-like updates (low rank + noise, filter-shaped); fp16 cast first, as
    the code did, loses the whole update once the norm passes fp16's 65504 (distance 1: all zeros)
    and much of it at tiny scales (fp16's subnormals: 0.16 at 1e-6). fp32 would be closer still,
    at an eighth of a V100's tensor-core rate."""
    torch.manual_seed(0)
    rows, worst = [], {}
    for shape in [(64, 216), (256, 576)]:  # wide filters as Muon flattens them (out x in*3*3)
        for scale in (1e-6, 1.0, 1e2, 1e3):  # mean |entry|: summed-loss gradients span these
            g = torch.randn(shape[0], 8) @ torch.randn(8, shape[1]) + 0.1 * torch.randn(shape)
            g = g * scale / g.abs().mean()
            ref = newton_schulz(g, 3, dtype=torch.float32)
            d = {
                "bf16": newton_schulz(g, 3, dtype=torch.bfloat16),
                "fp16": newton_schulz(g, 3, dtype=torch.float16),
                "fp16 cast first": cast_first(g, 3, torch.float16),
            }
            d = {k: float((v.float() - ref).norm() / ref.norm()) for k, v in d.items()}
            rows.append(f"{shape} x{scale:g}: " + ", ".join(f"{k} {v:.2e}" for k, v in d.items()))
            for k, v in d.items():
                worst[k] = max(worst.get(k, 0.0), v)
            assert d["fp16"] <= d["bf16"], "\n".join(rows)
    table = "\n".join(rows)
    print("relative distance to the fp32 iteration:\n" + table)
    assert worst["fp16"] < 0.01 < worst["bf16"], table
    assert worst["fp16 cast first"] == pytest.approx(1.0), table  # why the scaling comes first


def test_capability_8_0_and_up_keep_the_cast_first_bf16_iteration():
    """Hopper's (and Ampere's) Newton-Schulz is what it was: bf16, cast then scaled, bit for bit."""
    g = torch.randn(3, 32, 72, generator=torch.Generator().manual_seed(3))
    for k in range(3):
        assert torch.equal(newton_schulz(g[k], 3, dtype=torch.bfloat16), cast_first(g[k], 3, torch.bfloat16))


@pytest.mark.slow
def test_capability_7_0_under_torch_2_10_trains_with_fp16_newton_schulz(monkeypatch, tmp_path, learnable_data):
    """A V100 under torch 2.10's arch list: the preflight passes and the policy gives fp16; a short
    CPU run of the Muon preset with that policy (the only thing here a V100 would change) takes fp16
    Newton-Schulz steps, learns, and logs the choice with the run's engine."""
    with monkeypatch.context() as m:
        fake_gpus(m, 8, V100, TORCH_2_10_ARCHS)
        assert pick_device("cuda", 0, Config()) == torch.device("cuda", 0)
        v100 = gpu.newton_schulz_dtype(torch.device("cuda", 0))
    assert v100 == torch.float16
    monkeypatch.setattr(gpu, "newton_schulz_dtype", lambda device: v100)
    seen = []

    def spy(g, steps=3, eps=1e-7, dtype=None):
        seen.append(dtype)
        return real(g, steps, eps, dtype)

    real = optim.newton_schulz
    monkeypatch.setattr(optim, "newton_schulz", spy)
    cfg = from_preset("fast-muon", widths=(8, 16, 16), data=str(learnable_data), batch_size=100, epochs=2)
    cfg = dataclasses.replace(
        cfg,
        device="cpu",
        loader="torch",
        kernels="torch",
        cuda_graphs="off",
        eval_batch_size=200,
        warmup_steps=1,
        whiten_bias_epochs=1,
        out_dir=str(tmp_path / "runs"),
    )
    validate(cfg)
    (result,) = trainer.train(cfg, DistContext(0, 1, 0, torch.device("cpu"), None))
    assert seen and set(seen) == {torch.float16}
    assert result.epochs[-1].test_acc > 60.0, [e.test_acc for e in result.epochs]  # 10 classes: chance is 10%
    (summary,) = (tmp_path / "runs").glob("*/summary.json")
    assert json.loads(summary.read_text())["engine"]["newton-schulz"] == "float16"


# --- kernels by generation ------------------------------------------------------------------------


def test_capability_below_8_0_gives_the_fused_conv_its_small_tiles(monkeypatch):
    """Volta and Turing: tl.dot has no mma there, and the 128 x 64 x 32 tiles spilled; every dtype
    takes the 64 x 32 x 16 tiles on 4 warps (tests/kernels/test_kernel_compile.py compiles them)."""
    cs = pytest.importorskip("fastcifar.kernels.conv_stats")
    for capability in (V100, (7, 5)):
        fake_gpus(monkeypatch, 1, capability, TORCH_2_10_ARCHS)
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            assert cs.launch_for(dtype, torch.device("cuda", 0)) == cs.ConvLaunch(64, 32, 16, 4, 1, 8)


def test_capability_sm_count_sizes_the_conv_grid(monkeypatch):
    """8 programs per SM: asked of the device once (a V100's 80 SMs, mocked), and the launcher's
    grid is the one that count gives, not an H100's."""
    cs = pytest.importorskip("fastcifar.kernels.conv_stats")
    calls = []
    fake_gpus(monkeypatch, 2, V100, TORCH_2_10_ARCHS, sms=80)
    props = torch.cuda.get_device_properties
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: calls.append(device) or props(device))
    assert [gpu.sm_count(torch.device("cuda", 1)) for _ in range(3)] == [80] * 3 and calls == [1]
    assert gpu.sm_count(torch.device("cpu")) == gpu.DEFAULT_SMS == 132

    grids = []

    class Kernel:  # records the grid instead of launching
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(cs, "_conv_stats_kernel", Kernel())
    monkeypatch.setattr(cs.gpu, "sm_count", lambda device: 80)
    x = torch.zeros(2000, 64, 15, 15, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    w = torch.zeros(256, 64, 3, 3, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    cs.conv_stats_forward(x, w, True, "before")
    rows = 2000 * 7 * 7  # the default preset's third conv, pooled before its batchnorm
    at = {sms: cs.conv_tiling(64, 256, rows, True, cs.LAUNCH, sms) for sms in (80, 132)}
    assert at[80].chunks != at[132].chunks  # the count matters at this shape
    assert grids == [(at[80].n_blocks, at[80].chunks)]


def test_capability_9_0_keeps_the_hopper_choices(monkeypatch):
    """Hopper (an H100 or H200: 9.0, 132 SMs) under the cu130 torch: what it ran before issue 69,
    unchanged. The preflight passes (also --compress bf16), Newton-Schulz is bf16 (cast first:
    test_capability_8_0_and_up_keep_the_cast_first_bf16_iteration), the fused conv keeps its tiles
    and 1056 programs, Triton kernels and CUDA graphs stay the default engines."""
    cs = pytest.importorskip("fastcifar.kernels.conv_stats")
    from fastcifar.models.blocks import resolve_kernels
    from fastcifar.run import graphs

    fake_gpus(monkeypatch, 1, (9, 0), CU130_ARCHS, sms=132)
    h100 = pick_device("auto", 0, Config(compress="bf16"))
    assert h100 == torch.device("cuda", 0)
    assert gpu.newton_schulz_dtype(h100) == torch.bfloat16
    assert cs.launch_for(torch.float16, h100) == cs.launch_for(torch.bfloat16, h100) == (128, 64, 32, 8, 2, 8)
    assert cs.launch_for(torch.float32, h100) == (64, 32, 16, 4, 1, 8)
    # the grid of 8 x 132 = 1056 programs the conv was written for
    tiling = cs.conv_tiling(256, 256, 2000 * 7 * 7, False, cs.LAUNCH, gpu.sm_count(h100))
    assert tiling.tiles_per_prog == -(-tiling.num_tiles // (1056 // tiling.n_blocks))
    assert resolve_kernels("auto", h100) == "triton" and graphs.resolve("auto", h100) == (True, "")


# --- the install lines ----------------------------------------------------------------------------


def test_capability_install_lines_are_the_readmes_and_pyprojects():
    """The line the preflight names for each generation is in README's Install table, its extra is
    in pyproject.toml, and no DALI build is a required dependency (the Volta line needs the CUDA 12
    one, the default the CUDA 13 one: both in one install write the same files)."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    readme = (ROOT / "README.md").read_text()
    start = readme.index("\n## Install\n")
    table = readme[start : readme.index("\n## ", start + 1)]
    for _, _, command in gpu.INSTALLS:
        assert command.replace("pip", ".venv/bin/pip", 1) in table, command
        extra = command.split("[")[1].split("]")[0]
        assert extra in project["optional-dependencies"], extra
    assert not [d for d in project["dependencies"] if d.startswith("nvidia-dali")]
    volta = project["optional-dependencies"]["volta"]
    assert any(d.startswith("torch>=2.10,<2.11") for d in volta) and any("nvidia-dali-cuda120" in d for d in volta)
    assert gpu.install_line(V100) == ("Volta (V100)", VOLTA_LINE) and gpu.install_line((6, 1)) is None
    assert gpu.install_line((12, 0))[1] == "pip install -e '.[dali]'"


def test_capability_checked_before_a_model_file_goes_to_the_gpu(monkeypatch):
    """evaluate, predict and the API load a model file onto --device cuda through one function: the
    same preflight refuses a V100 under the cu130 torch there, before the file's contents matter."""
    from fastcifar.models.files import network_from_weights

    fake_gpus(monkeypatch, 1, V100, CU130_ARCHS)
    with pytest.raises(ConfigError, match=r"^GPU 0 \(Tesla V100-SXM2-16GB, compute capability 7\.0\) cannot run torch"):
        network_from_weights({}, {}, "model.safetensors", "cuda:0")
    fake_gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match="^--device cuda was asked for, but PyTorch sees no CUDA GPU"):
        network_from_weights({}, {}, "model.safetensors", "cuda")


def test_a_missing_home_keeps_tritons_cache_off_it_wherever_a_gpu_is_taken(tmp_path, monkeypatch, capsys):
    """Triton compiles on any CUDA device, and would make $HOME/.triton from / down: the trainer's
    device (pick_device) and a model file loaded onto a GPU (evaluate, predict, the API) both send
    its cache to a temporary folder and say so on stderr."""
    from fastcifar.models.files import CheckpointError, network_from_weights

    fake_gpus(monkeypatch, 1)
    monkeypatch.setenv("HOME", str(tmp_path / "no" / "home"))
    monkeypatch.setenv("TRITON_HOME", "")  # empty is unset; the test's own value comes back afterwards
    assert pick_device("cuda", 0) == torch.device("cuda", 0)
    folders = [os.environ["TRITON_HOME"]]
    monkeypatch.setenv("TRITON_HOME", "")
    with pytest.raises(CheckpointError, match="unusable metadata"):  # the empty file, after the GPU's checks
        network_from_weights({}, {}, "model.safetensors", "cuda:0")
    folders.append(os.environ["TRITON_HOME"])
    err = capsys.readouterr().err
    for folder in folders:
        assert folder and Path(folder).is_dir() and f"Triton's kernel cache is {folder} for this run" in err
        Path(folder).rmdir()
    assert not (tmp_path / "no").exists()
