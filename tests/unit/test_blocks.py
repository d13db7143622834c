"""fastcifar.models.blocks: which block (torch or Triton kernel) each --kernels choice resolves to,
and the blocks built from it."""

import pytest
import torch

from fastcifar.core.config import ConfigError
from fastcifar.models.resnet9 import ResNet9
from fastcifar.ops.norm_act_pool import NormActPool


def test_kernel_paths_resolve_and_build(monkeypatch):
    from fastcifar.kernels.bn_act_pool import TritonNormActPool
    from fastcifar.models.blocks import norm_factory, resolve_kernels

    assert resolve_kernels("auto", torch.device("cpu")) == "torch"
    assert resolve_kernels("auto", torch.device("cuda")) == "triton"
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: False)
        m.delenv("FASTCIFAR_ALLOW_INTERPRETER", raising=False)  # minutes per epoch: refused unless asked for
        with pytest.raises(ConfigError, match="FASTCIFAR_ALLOW_INTERPRETER=1"):
            resolve_kernels("triton", torch.device("cpu"))
        m.setenv("FASTCIFAR_ALLOW_INTERPRETER", "1")
        assert resolve_kernels("triton", torch.device("cpu")) == "triton"  # Triton's interpreter
        m.setattr(torch.cuda, "is_available", lambda: True)  # Triton compiles: CPU tensors would fail at launch
        with pytest.raises(ConfigError, match="--kernels triton on the CPU"):
            resolve_kernels("triton", torch.device("cpu"))
        assert resolve_kernels("triton", torch.device("cuda")) == "triton"
    model = ResNet9(widths=(4, 8, 8, 8), norm=norm_factory("triton"))
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and all(isinstance(m, TritonNormActPool) for m in norms)
    assert set(model.state_dict()) == set(ResNet9(widths=(4, 8, 8, 8)).state_dict())
    with pytest.raises(ValueError):
        resolve_kernels("cuda", torch.device("cpu"))


@pytest.mark.parametrize("arch", ["resnet9", "fastnet"])
def test_auto_on_cuda_fuses_every_block(arch):
    """``--kernels auto`` on CUDA builds every block from the fused Triton kernel (it beat cuDNN's
    batchnorm on every block measured, resolve_kernels), on the CPU from the plain-torch one, with the
    same state either way (checkpoints move between them); under --compile the block is the custom op."""
    from fastcifar.core.config import from_preset
    from fastcifar.kernels.bn_act_pool import TritonNormActPool
    from fastcifar.models import compiled
    from fastcifar.models.blocks import norm_blocks
    from fastcifar.models.network import make_network

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    fast = arch == "fastnet"
    cfg = from_preset("fast" if fast else "resnet9", widths=(8, 16, 16) if fast else (4, 8, 8, 8))
    fused = make_network(cfg, norm_blocks("auto", cuda))
    norms = [m for m in fused.modules() if isinstance(m, NormActPool)]
    assert {m.pool for m in norms} >= {None} and len({m.pool for m in norms}) == 2  # pooled and unpooled
    assert all(isinstance(m, TritonNormActPool) for m in norms)
    assert norm_blocks("triton", cuda) is TritonNormActPool and norm_blocks("auto", cpu) is NormActPool
    assert norm_blocks("torch", cuda) is NormActPool
    assert set(fused.state_dict()) == set(make_network(cfg, NormActPool).state_dict())
    assert compiled.norm_for(norm_blocks("auto", cuda), True).__name__ == "CompiledNormActPool"


@pytest.mark.slow  # trains a run in a fresh interpreter
def test_without_triton_the_cpu_trains_and_the_triton_kernels_are_one_line(tmp_path, monkeypatch):
    """A CPU install leaves Triton out (pyproject's triton extra): the default preset's CPU run,
    with the default preset's FastNet and its whitening, the loader's augmentation and TTA, imports
    no triton; --kernels triton says in one line which extra brings it."""
    import subprocess
    import sys

    from cli import ROOT, env
    from conftest import make_images, write_official
    from PIL import Image

    from fastcifar.models.blocks import resolve_kernels

    data, _ = write_official(tmp_path / "data", per_batch=100, n_test=100)
    Image.fromarray(make_images(1, seed=5)[0][0]).save(tmp_path / "cat.png")
    code = f"""
import sys
sys.modules["triton"] = None  # `import triton` raises ImportError, as where it is not installed
from fastcifar.train import main
args = ["--data", {str(data)!r}, "--out-dir", {str(tmp_path / "runs")!r}, "--device", "cpu", "--subset", "200",
        "--epochs", "1", "--widths", "8,8,8", "--batch-size", "100", "--warmup-steps", "1", "--quiet"]
assert main(args) == 0
import glob
import fastcifar
(model,) = glob.glob({str(tmp_path / "runs" / "*" / "model.safetensors")!r})
fastcifar.evaluate(model, {str(data)!r})  # the model file's commands too: evaluate, predict
(guess,) = fastcifar.predict(model, [{str(tmp_path / "cat.png")!r}])
assert guess.top
assert sys.modules["triton"] is None and not [m for m in sys.modules if m.startswith("triton.")]
print("TRAINED WITHOUT TRITON")
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "TRAINED WITHOUT TRITON" in proc.stdout, proc.stderr[-3000:]

    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setenv("FASTCIFAR_ALLOW_INTERPRETER", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"needs the triton package.*pip install -e '\.\[triton\]'"):
        resolve_kernels("triton", torch.device("cpu"))
    assert resolve_kernels("auto", torch.device("cpu")) == "torch"
