"""The Python API: the README's example runs, fastcifar.train is callable before and after
``import fastcifar.train``, ``python -m`` stays quiet, and train() validates as the CLI does."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from cli import ROOT, env
from conftest import make_images, one_line_error, write_official
from PIL import Image

import fastcifar
from fastcifar.core.config import ConfigError, from_preset
from fastcifar.core.options import parse_args
from fastcifar.train import main as train_main


def python(code: str, cwd, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow  # runs the README's example training (a minute of both cores)
def test_readme_example_runs_and_train_is_callable_before_and_after_import(tmp_path):
    """The README's example, in a fresh interpreter: its fastcifar.train(cfg) comes before anything
    imported the trainer module; after ``import fastcifar.train`` the attribute is that module and
    still trains when called (a one-epoch run of 200 images: that the same settings give the same
    network is tests/distributed/test_controlled_runs.py's)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Python API") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    write_official(tmp_path / "data", per_batch=400, n_test=200)  # ./data, 2,000 images: the example's subset
    Image.fromarray(make_images(1, seed=5)[0][0]).save(tmp_path / "cat.png")
    before = "import sys\nimport fastcifar\nassert 'fastcifar.train' not in sys.modules, 'imported too early'\n"
    after = """
import torch
assert isinstance(run.model, torch.nn.Module) and len(run.metrics.epochs) == 4
assert abs(acc - run.test_acc) < 1e-9, (acc, run.test_acc)
assert cfg.subset == 2000 and cfg.device == "cpu"  # a short CPU run, not the whole set
assert run.test_acc > 50 and info.classes[0] == "airplane" and len(p.top) == 3
import fastcifar.train
from fastcifar import train
assert fastcifar.train is sys.modules["fastcifar.train"] is train
import dataclasses
(again,) = train(dataclasses.replace(cfg, subset=200, epochs=1, save_model=False))  # callable as the module too
assert again.model.fc.weight.shape == run.model.fc.weight.shape and len(again.metrics.epochs) == 1
print("EXAMPLE OK")
"""
    proc = python(before + code + after, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "EXAMPLE OK" in proc.stdout and "cat.png [(" in proc.stdout
    assert f"evaluated again: {proc.stdout.split('%', 1)[0].split()[-1]}%" in proc.stdout, "the accuracy, shown"


@pytest.mark.parametrize("module", ["fastcifar.train", "fastcifar.evaluate", "fastcifar.predict", "fastcifar.export"])
@pytest.mark.slow  # over 2 s on 2 cores
def test_python_m_help_prints_no_warning(module):
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.startswith("usage:")
    assert proc.stderr == "", f"python -m {module} wrote to stderr:\n{proc.stderr}"


def test_train_validates_exactly_as_the_cli(learnable_data, tmp_path, capsys):
    flags = ["--epochs", "2", "--warmup-epochs", "3"]
    assert train_main(["--data", str(learnable_data), "--out-dir", str(tmp_path / "cli"), *flags]) == 2
    cli_line = one_line_error(capsys.readouterr().err)
    cfg = from_preset("fast", data=str(learnable_data), out_dir=str(tmp_path / "api"), epochs=2, warmup_epochs=3.0)
    with pytest.raises(ConfigError) as err:
        fastcifar.train(cfg)
    assert cli_line == f"fastcifar: error: {err.value}"
    assert not (tmp_path / "api").exists() and not (tmp_path / "cli").exists()
    with pytest.raises(ConfigError, match=r"--batch-size must lie in 1\.\.65536"):
        fastcifar.train(from_preset("fast", batch_size=0))
    with pytest.raises(ConfigError, match="takes a fastcifar.Config"):
        fastcifar.train({"epochs": 1})


def test_from_preset_shortens_like_the_command_line():
    for epochs in (1, 5, 20):
        assert from_preset(epochs=epochs) == parse_args(["--epochs", str(epochs)])  # the default preset
        # fast warms up over 0.23 of its epochs: the warm-up scales with --epochs in both
        assert from_preset("fast", epochs=epochs) == parse_args(["--preset", "fast", "--epochs", str(epochs)])
    assert from_preset("fast", epochs=5, warmup_epochs=1.0).warmup_epochs == 1.0


def test_predict_and_evaluate_take_a_run_in_memory(tmp_path):
    """A run from train() (no file needed) goes straight into evaluate and predict."""
    from fastcifar.api import TrainedRun
    from fastcifar.models.files import ModelInfo
    from fastcifar.models.network import make_network
    from fastcifar.ops.norm_act_pool import NormActPool
    from fastcifar.run.report import RunResult

    cfg = from_preset("resnet9", widths=(8, 8, 16, 16), tta=0)
    net = make_network(cfg, NormActPool, 10).eval()
    run = TrainedRun(net, ModelInfo(cfg, tuple("abcdefghij"), (125.0,) * 3, (63.0,) * 3, 0.0), RunResult(1, 0, 0, 0, 0))
    images = make_images(5, seed=3)[0]
    preds = fastcifar.predict(run, images, top=2)
    assert [p.path for p in preds] == [f"[{i}]" for i in range(5)] and all(len(p.top) == 2 for p in preds)
    assert all(c in "abcdefghij" for p in preds for c, _ in p.top)
    with pytest.raises(fastcifar.DataError, match="uint8"):
        fastcifar.predict(run, images.astype(np.float32))


@pytest.mark.parametrize("wrap", ["tuple", "run"])
def test_resolve_model_leaves_the_callers_network_as_it_is(wrap):
    """(network, info) and a TrainedRun take one path: a network not fp32 on the target device is
    copied, never cast or moved in place (a CUDA network of Triton blocks would otherwise run them
    on CPU tensors)."""
    from fastcifar.api import TrainedRun, resolve_model
    from fastcifar.models.files import ModelInfo
    from fastcifar.models.network import make_network
    from fastcifar.ops.norm_act_pool import NormActPool
    from fastcifar.run.report import RunResult

    cfg = from_preset("resnet9", widths=(8, 8, 16, 16), tta=0)
    net = make_network(cfg, NormActPool, 10).half()  # in train mode, as a run leaves it mid-training
    before = {k: v.clone() for k, v in net.state_dict().items()}
    info = ModelInfo(cfg, tuple("abcdefghij"), (125.0,) * 3, (63.0,) * 3, 0.0)
    given = (net, info) if wrap == "tuple" else TrainedRun(net, info, RunResult(1, 0, 0, 0, 0))
    got, got_info = resolve_model(given, "cpu")
    assert got is not net and got_info is info
    assert all(t.dtype == torch.float16 for t in net.parameters()) and net.training
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert all(t.dtype == torch.float32 for t in got.parameters()) and not got.training
    assert all(torch.equal(before[k].float(), v.float()) for k, v in got.state_dict().items())
    same, _ = resolve_model((got, info), "cpu")  # already fp32 on the device: no copy
    assert same is got


@pytest.mark.cuda
def test_a_cuda_network_of_triton_blocks_evaluates_on_the_cpu():
    from fastcifar.api import resolve_model
    from fastcifar.models.blocks import norm_factory
    from fastcifar.models.files import ModelInfo
    from fastcifar.models.network import make_network
    from fastcifar.ops.norm_act_pool import NormActPool

    cfg = from_preset("resnet9", widths=(8, 8, 16, 16), tta=0)
    # channels-last, as build_model and load_model leave it: the Triton kernels take no other layout
    net = make_network(cfg, norm_factory("triton"), 10).to("cuda", memory_format=torch.channels_last).eval()
    info = ModelInfo(cfg, tuple("abcdefghij"), (125.0,) * 3, (63.0,) * 3, 0.0)
    got, _ = resolve_model((net, info), "cpu")
    assert next(net.parameters()).is_cuda and any(
        type(m) is not NormActPool for m in net.modules() if isinstance(m, NormActPool)
    )
    assert all(type(m) is NormActPool for m in got.modules() if isinstance(m, NormActPool))
    x = torch.randn(2, 3, 32, 32)
    want = net(x.cuda().contiguous(memory_format=torch.channels_last)).cpu()
    torch.testing.assert_close(got(x), want, rtol=1e-3, atol=1e-3)
    same, _ = resolve_model((net, info), "cuda")  # "cuda" names the device the net is on: no copy
    assert same is net


@pytest.mark.slow  # trains until the run diverges
def test_an_api_run_that_diverges_closes_its_log_as_the_cli_does(learnable_data, tmp_path):
    """Diverged is a BaseException: train() must still close the run's log with its status, or a
    later failure in the same process would write into this run's summary."""
    import json

    from fastcifar.core import signals
    from fastcifar.run import report

    out = tmp_path / "runs"
    cfg = from_preset(
        "resnet9",
        data=str(learnable_data),
        out_dir=str(out),
        device="cpu",
        widths=(8, 16, 32, 64),
        batch_size=100,
        epochs=1,
        warmup_steps=1,
        lr=1e6,
        save_model=False,
        quiet=True,
    )
    with pytest.raises(signals.StopRun):
        fastcifar.train(cfg)
    assert not report._OPEN
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "diverged"


@pytest.mark.parametrize(
    "tta, share, scope, val_split",
    [(2, 0.5, "batch", 0), (2, 0.5, "test", 0), pytest.param(1, 1.0, "batch", 100, marks=pytest.mark.slow)],
)
def test_per_example_outputs_are_what_the_accuracy_counted_in_memory_and_on_disk(
    learnable_data, tmp_path, tta, share, scope, val_split
):
    """--save-outputs both, two runs on a --subset: each run's test logits give its reported
    accuracy to the image (TTA share and a padded last batch included; with --val-split, the test
    set's one evaluation), the margins' signs say the same, the training outputs cover every
    training image of the data set in its order, plain view; the API's arrays are the files'."""
    import json

    from fastcifar.data import load_dataset
    from fastcifar.evaluate import logits_of
    from fastcifar.ops.augment import CIFAR10_MEAN, CIFAR10_STD

    out = tmp_path / "runs"
    cfg = from_preset(
        "resnet9",
        data=str(learnable_data),
        out_dir=str(out),
        device="cpu",
        widths=(8, 16, 32, 64),
        batch_size=100,
        epochs=1,
        warmup_steps=1,
        subset=700,  # the test set is cut to 280: batches of 150 + 130, the last one padded
        eval_batch_size=150,
        tta=tta,
        tta_share=share,
        tta_scope=scope,  # "test": the share of the whole test set, one table of logits
        val_split=val_split,
        runs=2,
        save_outputs="both",
        quiet=True,
    )
    runs = fastcifar.train(cfg)
    whole = load_dataset(str(learnable_data))
    test_labels = whole.subset(700).test_labels
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    summary = json.loads((run_dir / "summary.json").read_text())
    for n, run in enumerate(runs, 1):
        o = run.outputs
        assert o.test_logits.dtype == o.train_logits.dtype == np.float16
        assert o.test_margins.dtype == o.train_margins.dtype == np.float32
        assert o.test_logits.shape == (280, 10) and o.train_logits.shape == (1000, 10)
        correct = int((o.test_logits.argmax(1) == test_labels).sum())
        assert 100.0 * correct / 280 == run.test_acc  # the evaluation's own arithmetic: equal to the bit
        assert int((o.test_margins > 0).sum()) == correct
        files = summary["results"][n - 1]["output_files"]
        assert files == {
            name: f"outputs-run{n}/{name}.npy"
            for name in ("test_logits", "test_margins", "train_logits", "train_margins")
        }
        for name, path in files.items():
            on_disk = np.load(run_dir / path, mmap_mode="r")
            assert on_disk.dtype == getattr(o, name).dtype and np.array_equal(on_disk, getattr(o, name))
        plain = logits_of(run.model, whole.train_images, mean=CIFAR10_MEAN, std=CIFAR10_STD, tta=0, batch_size=150)
        np.testing.assert_allclose(o.train_logits.astype(np.float32), plain.numpy(), rtol=2e-3, atol=2e-3)
        labels = torch.from_numpy(whole.train_labels)
        expected = plain.gather(1, labels[:, None])[:, 0] - plain.scatter(1, labels[:, None], -np.inf).amax(1)
        np.testing.assert_allclose(o.train_margins, expected.numpy(), rtol=1e-4, atol=1e-5)
    assert not np.array_equal(runs[0].outputs.test_logits, runs[1].outputs.test_logits)  # two seeds, two files
