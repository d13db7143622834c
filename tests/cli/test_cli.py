"""The `fastcifar` command and its subcommands, the trainer's grouped --help and lr units, the
messages after a failed download, and `fastcifar export` checked with onnxruntime."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from broken_imports import break_import
from cli import FAST_SHORT, ROOT, env
from conftest import make_images, one_line_error, write_official

import fastcifar
from fastcifar import cli, evaluate, export, train
from fastcifar.core.config import Config, from_preset
from fastcifar.core.options import build_parser
from fastcifar.core.presets import DEFAULT_PRESET
from fastcifar.models.files import load_model

COMMANDS = ("train", "evaluate", "predict", "checkpoint", "export", "sweep")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny `fast` run (TTA level 2) on learnable data: (model file, its log.txt, data folder)."""
    root = tmp_path_factory.mktemp("trained")
    data, _ = write_official(root / "data", per_batch=200, n_test=400)
    out = root / "runs"
    assert train.main(["--data", str(data), "--out-dir", str(out), *FAST_SHORT, "--epochs", "2", "--quiet"]) == 0
    (model,) = out.glob("*/model.safetensors")
    return model, (model.parent / "log.txt").read_text(), data


# --- one command ------------------------------------------------------------------------------


def test_help_lists_every_command_in_one_line_each(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fastcifar {train,evaluate,predict,checkpoint,export,sweep}")
    for name in COMMANDS:
        (line,) = [line for line in out.splitlines() if line.strip().startswith(name + " ")]
        assert len(line.split()) > 2, line  # the name and what it does


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"fastcifar {fastcifar.__version__}"


@pytest.mark.parametrize("argv", [[], ["bogus"], ["--train"]], ids=["none", "unknown", "a flag"])
def test_no_or_unknown_command_is_exit_2(argv, capsys):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    if argv:  # one line, naming the commands
        line = one_line_error(captured.err)
        assert line.startswith(f"fastcifar: error: unknown command {argv[0]!r}") and all(c in line for c in COMMANDS)
    else:  # the usage and the list of commands
        assert captured.err.startswith("usage: fastcifar ") and all(f"  {c} " in captured.err for c in COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_runs_under_its_own_name(name, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main([name, "--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: fastcifar {name} ")


def test_a_commands_error_through_the_dispatcher_is_one_line(tmp_path, capsys):
    assert cli.main(["train", "--data", str(tmp_path / "missing"), "--out-dir", str(tmp_path / "runs")]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith("fastcifar: error: ") and "no such file or folder" in line
    assert cli.main(["evaluate", str(tmp_path / "none.safetensors"), "--data", str(tmp_path)]) == 2
    assert one_line_error(capsys.readouterr().err).startswith("fastcifar: error: ")


@pytest.mark.parametrize(
    "message, line",
    [
        ("\nCUDA error: out of memory\nCompile with `TORCH_USE_CUDA_DSA`", "CUDA error: out of memory"),
        ("  \n\t\n  no kernel image  \n", "no kernel image"),
        ("\n \n", "RuntimeError"),  # no words at all: the error's type
    ],
)
def test_an_error_is_its_first_line_with_words_in_it(message, line, capsys):
    """A message that starts with a newline (CUDA's do) printed as "fastcifar: error: " and
    nothing else: the first line with something on it is quoted (core.errors.first_line)."""
    from fastcifar.core.errors import first_line

    def body():
        raise RuntimeError(message)

    assert first_line(message) == ("" if line == "RuntimeError" else line)
    assert cli.run_command(body) == 2
    assert capsys.readouterr().err == f"fastcifar: error: {line}\n"


def test_console_scripts_and_extras_in_pyproject():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["fastcifar"] == "fastcifar.cli:main"
    assert project["scripts"]["fastcifar-train"] == "fastcifar.train:main"  # kept
    extras = project["optional-dependencies"]
    assert any(d.startswith("onnxruntime") for d in extras["onnx"]) and any(
        d.startswith("onnx>") for d in extras["onnx"]
    )
    assert not any(d.startswith("onnx") for d in project["dependencies"]), "training must not need onnx"
    # Triton (0.9 GB) is an extra: a CPU install trains without it; torch's CUDA wheels bring their own
    assert not any(d.startswith("triton") for d in project["dependencies"])
    assert [d.split(">")[0] for d in extras["triton"]] == ["triton"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]  # SPDX: PEP 639


def test_python_m_fastcifar_is_the_same_command():
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "fastcifar", *args], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300
        )

    proc = run("--help")
    assert proc.returncode == 0 and proc.stderr == "" and "export" in proc.stdout
    proc = run("predict", "--help")
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout.startswith("usage: python -m fastcifar predict")
    proc = run()
    assert proc.returncode == 2 and proc.stderr.startswith("usage: python -m fastcifar ")


CONSOLE_SCRIPT = "import sys; from fastcifar.cli import main; sys.exit(main())"  # what pip's `fastcifar` runs


@pytest.mark.parametrize("how", [["-m", "fastcifar"], ["-c", CONSOLE_SCRIPT]])
@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_into_a_closed_pipe_ends_quietly(how, flag):
    """`fastcifar --help | head -1` (the console script is the -c form) whose reader is gone before the
    text is written: the shell's quiet 141, no BrokenPipeError traceback. Several tries, as the race
    between the reader leaving and the write went either way; a write that lands first is exit 0."""
    statuses = set()
    for _ in range(4):
        proc = subprocess.Popen(
            [sys.executable, *how, flag], cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        proc.stdout.close()  # the reader leaves before the first line
        err = proc.stderr.read()
        statuses.add(proc.wait(timeout=120))
        assert err == "", err[-2000:]
    assert statuses <= {0, 128 + signal.SIGPIPE}, statuses


# --- the trainer's --help and the lr units --------------------------------------------------------


def test_train_help_is_grouped_basic_options_first():
    parser = build_parser(from_preset(DEFAULT_PRESET))
    groups = {g.title: [a for a in g._group_actions] for g in parser._action_groups}
    titles = [t for t, actions in groups.items() if actions]
    assert titles[:3] == ["options", "basic options", "data"]  # options: -h only
    assert {
        "model",
        "recipe",
        "engines",
        "distributed (torchrun)",
        "compressed gradient communication",
        "sparse training and local SGD",
        "checkpoints and model files",
        "output and logging",
    } <= set(titles)
    basic = {a.dest for a in groups["basic options"]}
    assert {"preset", "data", "download", "device", "epochs", "batch_size", "lr"} <= basic
    assert {a.dest for a in groups["distributed (torchrun)"]} >= {"comm", "bucket_mb", "dist_timeout_s"}
    grouped = {a.dest for t, actions in groups.items() if t != "options" for a in actions}
    shown = {f.name for f in dataclasses.fields(Config) if f.name != "preset" and f.metadata["group"] != "testing"}
    assert shown <= grouped, "every field in a named group"
    text = parser.format_help()
    assert "FastNet 64/256/256" in text and "ResNet-style" not in text
    lr_help = next(a.help for a in groups["basic options"] if a.dest == "lr")
    assert "mean loss" in lr_help and "per 512 images of global batch" in lr_help and "lr x batch-size / 512" in lr_help
    assert "lr column" in text and "27.136 x 2000 / 512 = 106)" in " ".join(text.split())


@pytest.mark.slow  # trains a run to read its log
def test_the_logs_lr_column_is_explained_with_its_peak(trained):
    _, stdout, _ = trained
    cfg = from_preset("fast")  # FAST_SHORT: batch 100, --lr the preset's
    peak = cfg.lr * 100 / 512
    lines = stdout.splitlines()
    (note,) = [line for line in lines if line.startswith("lr: ")]
    assert f"x 100/512 = {peak:.4f}" in note and "mean loss over the global batch of 100" in note
    assert lines.index(note) + 1 == next(
        i for i, line in enumerate(lines) if line.split()[:3] == ["run", "epoch", "lr"]
    )
    rows = [line.split() for line in lines if line.split()[:2] in (["1", "1"], ["1", "2"])]
    assert rows and all(0 < float(r[2]) <= peak + 1e-4 for r in rows)


# --- after a failed download ----------------------------------------------------------------


@pytest.fixture
def offline(monkeypatch):
    """The fetch fails as it does without a network."""

    def fail(url, *args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", fail)


TINY = ["--preset", "resnet9", "--device", "cpu", "--widths", "8,8,16,16", "--epochs", "1", "--quiet"]


@pytest.mark.parametrize("where", ["data", "a/b/data"])
def test_a_failed_download_says_how_to_fetch_by_hand_and_leaves_no_folder(where, offline, tmp_path, capsys):
    data = tmp_path / where
    argv = ["--data", str(data), "--out-dir", str(tmp_path / "runs"), *TINY]
    assert train.main([*argv, "--download"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert (
        line.startswith("fastcifar: error: download of https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz failed")
        and "Temporary failure" in line
    )
    assert "by hand" in line and f"put cifar-10-python.tar.gz in {data}/" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "no empty data folder (nor its parents) left"
    assert train.main(argv) == 2  # the next run, without --download
    line = one_line_error(capsys.readouterr().err)
    assert f"{data}: no such file or folder; pass --download" in line and "by hand" in line
    assert f"put cifar-10-python.tar.gz in {data}/" in line


def test_a_failed_download_keeps_a_folder_that_was_there(offline, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    argv = ["--data", str(data), "--out-dir", str(tmp_path / "runs"), *TINY]
    assert train.main([*argv, "--download"]) == 2
    assert "download of" in one_line_error(capsys.readouterr().err)
    assert data.is_dir() and not any(data.iterdir()), "the user's folder stays, emptied of the partial download"
    assert train.main(argv) == 2
    line = one_line_error(capsys.readouterr().err)
    assert f"{data}: empty folder; pass --download" in line and "by hand" in line


def test_evaluate_suggests_no_download_flag(trained, tmp_path, capsys):
    model, _, _ = trained
    (tmp_path / "empty").mkdir()
    for data, what in [(tmp_path / "missing", "no such file or folder"), (tmp_path / "empty", "empty folder")]:
        assert evaluate.main([str(model), "--data", str(data)]) == 2
        line = one_line_error(capsys.readouterr().err)
        assert line.startswith(
            f"fastcifar: error: {data}: {what}; for official CIFAR-10, fetch "
            "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz by hand"
        ), line
        assert "--download" not in line
    with pytest.raises(SystemExit):  # evaluate indeed has no such flag
        evaluate.main([str(model), "--data", str(tmp_path), "--download"])


# --- fastcifar export -----------------------------------------------------------------------


def _onnxruntime():
    return pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install 'fastcifar[onnx]')")


def test_export_matches_pytorch_and_predict_under_onnxruntime(trained, tmp_path, capsys):
    ort = _onnxruntime()
    pytest.importorskip("onnx", reason="onnx is not installed (pip install 'fastcifar[onnx]')")
    model, _, _ = trained
    out = tmp_path / "model.onnx"
    assert cli.main(["export", str(model), "--onnx", str(out), "--opset", "17"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "checked with onnxruntime" in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"], "no temporary file left"

    net, info = load_model(model)
    assert info.config.tta == 2  # predict's default would average 6 views; the ONNX graph is the plain forward
    images = make_images(7, seed=5)[0]  # uint8 NHWC
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (inp,), (outp,) = session.get_inputs(), session.get_outputs()
    assert (inp.name, inp.type, outp.name) == ("images", "tensor(float)", "logits")
    assert not isinstance(inp.shape[0], int), "the batch axis is free"
    nchw = images.transpose(0, 3, 1, 2).astype(np.float32)  # the contract: 0..255 RGB, channels first
    logits = session.run(None, {"images": nchw})[0]
    assert logits.shape == (7, len(info.classes))
    assert session.run(None, {"images": nchw[:1]})[0].shape == (1, len(info.classes))  # another batch size
    want = evaluate.logits_of(net, images, mean=info.mean, std=info.std, tta=0, batch_size=100).numpy()
    np.testing.assert_allclose(logits, want, rtol=0, atol=1e-4)
    import fastcifar.predict as predict_module

    preds = predict_module.predict(model, images, top=1, tta=0)
    assert [p.top[0][0] for p in preds] == [info.classes[k] for k in logits.argmax(1)]


def test_export_refuses_an_existing_file_unless_force(trained, tmp_path, capsys):
    pytest.importorskip("onnx", reason="onnx is not installed (pip install 'fastcifar[onnx]')")
    model, _, _ = trained
    out = tmp_path / "model.onnx"
    out.write_bytes(b"mine")
    assert export.main([str(model), "--onnx", str(out)]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert line == f"fastcifar: error: {out} exists; pass --force to overwrite it"
    assert out.read_bytes() == b"mine"
    assert export.main([str(model), "--onnx", str(out), "--force"]) == 0
    assert out.read_bytes() != b"mine" and sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


@pytest.mark.parametrize(
    "case", ["no onnx", "broken onnx", "broken onnxruntime", "opset 5", "opset 99", "a folder", "not a model"]
)
def test_export_errors_are_one_line_and_write_nothing(case, trained, tmp_path, capsys, monkeypatch):
    model, _, _ = trained
    argv = [str(model), "--onnx", str(tmp_path / "m.onnx")]  # its folder exists: a missing one is refused first
    if case == "no onnx":
        monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx raises ImportError
        message = "export needs the onnx package, which cannot be imported (not installed): pip install onnx"
    elif case.startswith("broken"):  # installed, and its import fails (issue 71)
        name = case.split()[1]
        if name == "onnxruntime":
            pytest.importorskip("onnx", reason="onnx is not installed (pip install 'fastcifar[onnx]')")
        break_import(
            name, tmp_path.parent / f"{tmp_path.name}-fake", f"operator {name}::op does not exist", monkeypatch
        )
        message = (
            f"needs the {name} package, which cannot be imported (RuntimeError: operator {name}::op does not "
            "exist): pip install onnx onnxruntime"
        )
    elif case.startswith("opset"):  # 99: refused before the exporter, which would print its whole graph
        argv += ["--opset", case.split()[1]]
        message = f"--opset must lie in 11..{export.max_opset()}, not {case.split()[1]}"
    elif case == "a folder":
        argv[2] = str(tmp_path)
        message = "is a folder; --onnx takes a file name"
    else:
        argv[0] = str(tmp_path / "m.safetensors")
        Path(argv[0]).write_bytes(b"not safetensors")
        message = "not a readable model file"
    before = sorted(p.name for p in tmp_path.iterdir())
    assert export.main(argv) == 2
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith("fastcifar: error: ") and message in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_export_leaves_the_model_as_loaded(trained):
    """The export wraps the network; the caller's network is unchanged (still fp32, eval)."""
    pytest.importorskip("onnx", reason="onnx is not installed (pip install 'fastcifar[onnx]')")
    model, _, _ = trained
    net, info = load_model(model)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    blob = export.onnx_bytes(net, info.mean, info.std)
    assert blob[:2] and not net.training
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_export_makes_no_folders_and_the_checkpoint_is_not_a_model(trained, tmp_path, capsys):
    """A typo in --onnx's folder is refused (it made folders); a training checkpoint handed where a
    model file belongs says what it is and where the model is."""
    pytest.importorskip("onnx", reason="onnx is not installed (pip install -e '.[onnx]')")
    model, _, _ = trained
    assert export.main([str(model), "--onnx", str(tmp_path / "typo" / "m.onnx")]) == 2
    assert (
        one_line_error(capsys.readouterr().err)
        == f"fastcifar: error: {tmp_path / 'typo'}: no such folder (make it first)"
    )
    assert not (tmp_path / "typo").exists()
    ckpt = tmp_path / "checkpoint.pt"
    torch.save({"format": "fastcifar.state/1"}, ckpt)
    assert export.main([str(ckpt), "--onnx", str(tmp_path / "m.onnx")]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "a training checkpoint (for --resume)" in line and str(tmp_path / "model.safetensors") in line


@pytest.mark.parametrize(
    "command,argv", [("evaluate", ["--tta", "5", "m"]), ("predict", ["m"]), ("checkpoint", []), ("export", ["m"])]
)
def test_every_commands_usage_errors_are_one_line(command, argv, capsys):
    """argparse's own errors print the usage first; every command's are one line like all bad input."""
    with pytest.raises(SystemExit) as stop:  # argparse exits; the console script's status is 2
        cli.main([command, *argv])
    assert stop.value.code == 2
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith("fastcifar: error: ") and line.endswith(f"(see fastcifar {command} --help)")


@pytest.mark.slow  # over 2 s on 2 cores
def test_checkpoint_every_past_the_last_epoch_says_none_is_written(trained, tmp_path):
    _, _, data = trained
    out = tmp_path / "runs"
    assert (
        train.main(
            [
                "--data",
                str(data),
                "--out-dir",
                str(out),
                *FAST_SHORT,
                "--epochs",
                "1",
                "--quiet",
                "--checkpoint-every",
                "1",
            ]
        )
        == 0
    )
    (run_dir,) = out.glob("*")
    assert "note: --checkpoint-every 1 with 1 epochs writes no checkpoint" in (run_dir / "log.txt").read_text()
    assert not (run_dir / "checkpoint.pt").exists()


def test_train_help_shows_defaults_as_typed(capsys):
    """Defaults as a user would type them: widths comma-separated, derived rates to 6 digits."""
    with pytest.raises(SystemExit):
        train.main(["--help"])
    out = capsys.readouterr().out
    assert "(default: 64,256,256)" in out and "(default: 3.77358e-05)" in out
    assert "3.773584905660377e-05" not in out and "(default: None)" not in out
