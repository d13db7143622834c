"""Faults, round two (issue 70): files that lie, signals outside ``train``, the environment. Each case
ends in one line on stderr, a documented exit status, no traceback and nothing half-written.

Classes, in the order of the issue: a file that is not what its name says (a FIFO, a device, a
folder) is refused at once; a file whose bytes changed but still decode is refused by its digest;
hostile class names are refused when written and when read, and what predict prints never carries a
control character; SIGINT/SIGTERM during export and predict; bad OMP_NUM_THREADS and a missing HOME;
fp16 on the CPU; and the minor ones (checkpoint settings named as the checkpoint's, gloo's source
paths, .tif/.gif images, two exports to one path).
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cli import ROOT, SHORT, as_a_shell_starts_it, env, run_dirs, run_train
from conftest import one_line_error, write_image_folder, write_official
from models import TINY_WIDTHS, small_checkpoint_state, tiny_model_file
from PIL import Image

from fastcifar.core.config import from_preset
from fastcifar.models.files import CheckpointError, write_safetensors
from fastcifar.models.network import make_network
from fastcifar.ops.norm_act_pool import NormActPool
from fastcifar.run import state as run_state


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    return tiny_model_file(tmp_path_factory.mktemp("model") / "model.safetensors")


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for i in range(2):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return folder


def command(name: str, argv, capsys) -> tuple[int, str, str]:
    """``fastcifar NAME ARGV`` in this process: (exit status, stderr, stdout); never a traceback."""
    from fastcifar import cli

    code = cli.main([name, *map(str, argv)])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.err, out.out


# --- a file that is not what its name says: refused at once, in one line -----------------------


# The commands that read a model file, with their arguments ({f}: the file, {d}: data, {img}: an image,
# {out}: an output path)
MODEL_READERS = [
    ("evaluate", ["{f}", "--data", "{d}"]),
    ("predict", ["{f}", "{img}"]),
    ("export", ["{f}", "--onnx", "{out}"]),
    ("checkpoint", ["inspect", "{f}"]),
]


@pytest.mark.parametrize("what", ["fifo", "folder", "device"])
@pytest.mark.parametrize(
    "name, argv",
    [
        *MODEL_READERS,
        ("checkpoint", ["restore", "{f}", "--out", "{out}"]),
        ("checkpoint", ["seal", "{f}", "--out", "{out}"]),
    ],
)
def test_every_commands_model_file_argument_that_is_not_a_regular_file_is_one_line(
    what, name, argv, tmp_path, images, capsys
):
    path = {"fifo": tmp_path / "m.safetensors", "folder": tmp_path / "dir.safetensors", "device": Path("/dev/zero")}[
        what
    ]
    if what == "fifo":
        os.mkfifo(path)
    elif what == "folder":
        path.mkdir()
    out = tmp_path / "out.x"
    args = [a.format(f=path, d=tmp_path, img=images, out=out) for a in argv]
    code, err, _ = command(name, args, capsys)
    kind = {"fifo": "a FIFO (named pipe)", "folder": "a folder", "device": "a character device"}[what]
    line = one_line_error(err)
    assert (
        code == 2
        and line.startswith(f"fastcifar: error: {path}: cannot read ")
        and line.endswith(f": {kind}, not a regular file")
    )
    assert not out.exists()


def test_a_huge_sparse_file_named_as_a_model_or_checkpoint_is_refused_without_reading_it(tmp_path, images, capsys):
    """1 TB of zeros (a sparse file: no disk used) must be refused by its first or last bytes,
    not read into memory."""
    cfg, _ = small_checkpoint_state()
    for name in ("model.safetensors", "checkpoint.pt"):
        with open(tmp_path / name, "wb") as f:
            f.truncate(1 << 40)
    code, err, _ = command("predict", [tmp_path / "model.safetensors", images], capsys)
    assert code == 2 and "not a readable model file" in one_line_error(err)
    with pytest.raises(CheckpointError, match="not a readable checkpoint \\(not a zip archive"):
        run_state._read_state(tmp_path / "checkpoint.pt", cfg, 1)


def test_a_model_file_with_bytes_appended_is_refused_before_they_are_read(model_file, tmp_path, capsys):
    path = tmp_path / "m.safetensors"
    path.write_bytes(model_file.read_bytes() + b"\0" * 1000)
    code, err, _ = command("predict", [path, tmp_path], capsys)
    assert code == 2 and "the file has" in one_line_error(err) and "something appended" in err


def test_export_force_never_replaces_a_device_or_a_fifo(model_file, tmp_path, capsys):
    fifo = tmp_path / "m.onnx"
    os.mkfifo(fifo)
    for out, kind in ((Path("/dev/null"), "a character device"), (fifo, "a FIFO (named pipe)")):
        code, err, _ = command("export", [model_file, "--onnx", out, "--force"], capsys)
        assert code == 2 and one_line_error(err) == (
            f"fastcifar: error: {out} is {kind}, not a regular file; --force replaces only a file"
        )
    assert Path("/dev/null").is_char_device() and fifo.is_fifo()


# --- a file whose bytes changed but still decode: refused by its digest ---------------------------


def _flip_in_largest_tensor(path: Path) -> int:
    """Flip the lowest bit of the first element of the model file's largest tensor (a float's last
    mantissa bit: the file still decodes, every value finite); returns the byte's offset."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    name = max((k for k in header if k != "__metadata__"), key=lambda k: np.diff(header[k]["data_offsets"])[0])
    offset = 8 + n + header[name]["data_offsets"][0]
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))
    return offset


@pytest.mark.parametrize("name, argv", MODEL_READERS)
def test_a_model_file_with_one_flipped_byte_is_refused_by_every_command(name, argv, tmp_path, images, capsys):
    path = tiny_model_file(tmp_path / "model.safetensors")
    _flip_in_largest_tensor(path)
    tensors = __import__("safetensors.torch", fromlist=["load_file"]).load_file(path)
    assert all(bool(torch.isfinite(t).all()) for t in tensors.values()), "it still decodes, every value finite"
    before = path.read_bytes()
    out = tmp_path / "m.onnx"
    code, err, _ = command(name, [a.format(f=path, d=tmp_path, img=images, out=out) for a in argv], capsys)
    assert code == 2
    assert one_line_error(err) == (
        f"fastcifar: error: {path}: its contents do not match the digest written with them (sha256): the file "
        f"changed after it was written (a damaged disk or copy, or an edit); refusing to use it"
    )
    assert path.read_bytes() == before and not out.exists()


def test_a_flipped_byte_in_a_class_name_is_refused_too(tmp_path, capsys):
    path = tiny_model_file(tmp_path / "model.safetensors")
    blob = path.read_bytes()
    i = blob.index(b"automobile")
    path.write_bytes(blob[:i] + b"Automobile" + blob[i + 10 :])  # same length: the header still parses
    code, err, _ = command("predict", [path, tmp_path], capsys)
    assert code == 2 and "do not match the digest" in one_line_error(err)


def test_an_untouched_model_file_loads(model_file, images, capsys):
    """Its digest checked and matching: predict reads it, one line per image, nothing on stderr."""
    code, err, out = command("predict", [model_file, images], capsys)
    assert code == 0 and err == "" and len(out.splitlines()) == 2


def test_a_model_file_without_a_digest_is_refused_and_seal_writes_one(model_file, tmp_path, images, capsys):
    """A file written before digests (or with the key removed): refused, with the way out; sealing
    a copy (the user vouches for it) makes it load."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    old = tmp_path / "old.safetensors"
    with safe_open(str(model_file), framework="pt") as f:
        meta = {k: v for k, v in f.metadata().items() if k != "sha256"}
        save_file({k: f.get_tensor(k) for k in f.keys()}, str(old), metadata=meta)
    code, err, _ = command("predict", [old, images], capsys)
    assert code == 2 and "carries no digest" in one_line_error(err) and "checkpoint seal" in err
    new = tmp_path / "new.safetensors"
    code, err, out = command("checkpoint", ["seal", old, "--out", new], capsys)
    assert code == 0 and err == "" and out.startswith(f"wrote {new}")
    assert command("predict", [new, images], capsys)[0] == 0
    code, err, _ = command("checkpoint", ["seal", old, "--out", new], capsys)  # never overwrites
    assert code == 2 and one_line_error(err) == f"fastcifar: error: {new} exists; not overwriting it"


# --- class names: refused when written and when read ------------------------------------------


HOSTILE = [
    (("cat",) * 10, "'cat' and 'cat' name one class twice"),
    (("cat", "Cat"), "'cat' and 'Cat' name one class twice"),
    (("ca\nt", "dog"), "holds the unprintable character U+000A"),
    (("", "dog"), "name 0 is empty"),
    (("   ", "dog"), "name 0 is blank"),
    ((" cat", "dog"), "starts or ends with whitespace"),
    (("\u202ecat", "dog"), "U+202E (right-to-left override)"),
    (("c\u2066at", "dog"), "U+2066 (left-to-right isolate)"),
    (("c\x1b[31mat", "dog"), "U+001B"),
    (("cat\u200b", "dog"), "U+200B (zero width space)"),
    (("a/b", "dog"), "holds a path separator"),
    (("x" * 5000, "dog"), "is 5000 characters long (at most 100)"),
]


@pytest.mark.parametrize("names, message", HOSTILE)
def test_hostile_class_names_are_refused_when_saved(names, message, tmp_path):
    with pytest.raises(CheckpointError, match="not written: class names: .*" + re.escape(message)):
        tiny_model_file(tmp_path / "m.safetensors", names)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("names, message", HOSTILE)
@pytest.mark.parametrize("name", ["predict", "export", "evaluate"])
def test_hostile_class_names_in_a_model_file_are_refused_when_read(
    names, message, name, model_file, images, tmp_path, capsys
):
    """A model file edited to carry them, with a fresh digest (what a hostile editor writes)."""
    from safetensors import safe_open

    from fastcifar.models.files import host_state

    with safe_open(str(model_file), framework="pt") as f:
        meta = f.metadata()
    cfg = from_preset("fast", widths=TINY_WIDTHS)  # model_file's network
    tensors = host_state(make_network(cfg, NormActPool, len(names)))  # a last layer of len(names) classes
    path = write_safetensors(tmp_path / "m.safetensors", tensors, {**meta, "classes": json.dumps(list(names))})
    argv = {
        "predict": [path, images],
        "export": [path, "--onnx", tmp_path / "m.onnx"],
        "evaluate": [path, "--data", tmp_path],
    }
    code, err, out = command(name, argv[name], capsys)
    line = one_line_error(err)
    assert code == 2 and line.startswith(f"fastcifar: error: {path}: unusable metadata: classes: ") and message in line
    assert out == "" and line.isprintable()
    assert not (tmp_path / "m.onnx").exists()


def test_decent_class_names_of_any_script_are_taken(tmp_path, images, capsys):
    names = ("chat", "Ünïcode straße", "t-shirt", "猫", "<i>markup", "x" * 100)
    path = tiny_model_file(tmp_path / "m.safetensors", names)
    code, err, out = command("predict", [path, images, "--top", "6"], capsys)
    assert code == 0 and all(n in out for n in names)


@pytest.mark.parametrize("folder", ["ca\nt", "\u202edog", "c\x07at"])
def test_an_image_folder_with_a_hostile_class_folder_is_refused_before_decoding(folder, tmp_path, capfd):
    from fastcifar.train import main as train_main

    root, _ = write_image_folder(tmp_path / "data", n_train=20, n_test=10)
    for split in ("train", "test"):
        (root / split / "cat").rename(root / split / folder)
    out = tmp_path / "runs"
    code = train_main([*map(str, ["--data", root, *SHORT, "--out-dir", out])])
    line = one_line_error(capfd.readouterr().err)
    assert code == 2 and line.startswith(f"fastcifar: error: {root}: class folders under train/: name ")
    assert "unprintable character" in line and line.isprintable()
    assert not run_dirs(out)


def test_predict_escapes_a_file_name_that_holds_a_newline_or_a_bidi_override(model_file, tmp_path, capsys):
    rng = np.random.default_rng(1)
    for name in ("a\nb.png", "\u202eevil.png"):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(tmp_path / name)
    code, err, out = command("predict", [model_file, tmp_path], capsys)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert len(lines) == 2 and all(line.isprintable() for line in lines)
    assert any(line.startswith(f"{tmp_path}/a\\nb.png: ") for line in lines)


# --- signals during export and predict: one line, 130/143, nothing left -----------------------


# The command runs in a child with one step patched to send the signal to itself mid-way: during
# export's write (half of the file on disk), during predict's reading of its second image.
_SIGNAL_DURING = {
    "export": (
        "import fastcifar.core.atomic as a\n"
        "real = a._write_file\n"
        "def write(tmp, blob):\n"
        "    with open(tmp, 'wb') as f:\n"
        "        f.write(blob[: len(blob) // 2])\n"
        "    os.kill(os.getpid(), SIG)\n"
        "    time.sleep(5)\n"
        "    real(tmp, blob)\n"
        "a._write_file = write\n"
    ),
    "predict": (
        "import fastcifar.predict as p\n"
        "real = p.read_image\n"
        "seen = []\n"
        "def read(path):\n"
        "    seen.append(path)\n"
        "    if len(seen) == 2:\n"
        "        os.kill(os.getpid(), SIG)\n"
        "        time.sleep(5)\n"
        "    return real(path)\n"
        "p.read_image = read\n"
    ),
    "evaluate": (  # in the middle of the test set's forward passes
        "import fastcifar.evaluate as e\n"
        "real = e.logits_of\n"
        "def logits(*args, **kwargs):\n"
        "    os.kill(os.getpid(), SIG)\n"
        "    time.sleep(5)\n"
        "    return real(*args, **kwargs)\n"
        "e.logits_of = logits\n"
    ),
}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("name", ["export", "predict", "evaluate"])
def test_a_signal_during_export_or_predict_is_one_line_and_leaves_nothing(name, sig, model_file, images, tmp_path):
    if name == "export":
        pytest.importorskip("onnx", reason="onnx is not installed (pip install -e '.[onnx]')")
    out = tmp_path / "out"
    out.mkdir()
    data, _ = write_official(tmp_path / "data") if name == "evaluate" else (None, None)
    argv = {
        "export": [str(model_file), "--onnx", str(out / "m.onnx")],
        "predict": [str(model_file), str(images)],
        "evaluate": [str(model_file), "--data", str(data), "--cache-dir", str(out)],
    }[name]
    script = (
        f"import os, sys, time\nSIG = {int(sig)}\n"
        + _SIGNAL_DURING[name]
        + f"from fastcifar import cli\nsys.exit(cli.main({[name, *argv]!r}))\n"
    )
    proc = run_train(["-c", script], timeout=120, launcher=[sys.executable])
    assert proc.returncode == 128 + sig, proc.stderr[-3000:]
    assert one_line_error(proc.stderr) == f"fastcifar: interrupted by {signal.Signals(sig).name}"
    assert list(out.iterdir()) == [], "no .tmp, no half-written file"


def test_export_and_predict_put_the_callers_signal_handlers_back(model_file, images, capsys):
    before = signal.getsignal(signal.SIGINT)
    assert command("predict", [model_file, images], capsys)[0] == 0
    assert signal.getsignal(signal.SIGINT) is before


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (Python installs none by default)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("module", ["fastcifar.export", "fastcifar.predict"])
def test_a_signal_while_a_command_still_imports_is_one_line(module, sig, model_file, tmp_path):
    """The first seconds of a command import torch; a Ctrl-C then ended in runpy's traceback. The
    signal is sent as soon as the package has taken SIGTERM over (its import), wherever the command
    then is: the answer is the same one line and 128 + the signal."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc to see when the handlers are in place")
    argv = (
        [str(model_file), "--onnx", str(tmp_path / "m.onnx")]
        if module.endswith("export")
        else [str(model_file), str(tmp_path)]
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *argv],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_a_shell_starts_it,
    )
    deadline = time.monotonic() + 60
    while not _catches_sigterm(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert one_line_error(err) == f"fastcifar: interrupted by {signal.Signals(sig).name}"
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_predict_into_a_closed_pipe_ends_quietly_with_the_shells_status(model_file, images):
    """`fastcifar predict ... | head -1` whose reader is gone: no BrokenPipeError traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastcifar", "predict", str(model_file), str(images)],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # the reader leaves before the first line
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE and err == ""


# --- the environment ------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "abc", "-4", "1.5"])
@pytest.mark.parametrize(
    "how", [["-m", "fastcifar.train", "--data", "nowhere"], ["-m", "fastcifar", "predict", "m", "x"]]
)
def test_a_bad_omp_num_threads_is_one_line_of_fastcifars_own(value, how):
    proc = run_train(how, timeout=60, launcher=[sys.executable], extra_env={"OMP_NUM_THREADS": value})
    assert proc.returncode == 2
    assert one_line_error(proc.stderr) == (
        f"fastcifar: error: OMP_NUM_THREADS must be a positive whole number of threads (e.g. "
        f"OMP_NUM_THREADS=1), not {value!r}; unset it for torch's default (a thread per core)"
    )  # and not libgomp's "Invalid value for environment variable"


@pytest.mark.parametrize(
    "value, ok", [("1", True), ("2,1", True), (" 3 ", True), ("", True), ("0", False), ("4,x", False)]
)
def test_omp_num_threads_values_follow_the_openmp_syntax(value, ok):
    from fastcifar.core.environment import environment_problem

    assert (environment_problem({"OMP_NUM_THREADS": value}) is None) == ok
    mkl = environment_problem({"MKL_NUM_THREADS": value})  # MKL takes no list; it falls to 1 thread silently
    assert (mkl is None) == (ok and "," not in value) and (mkl is None or mkl.startswith("MKL_NUM_THREADS must"))


def test_a_thread_count_beyond_any_machine_is_refused():
    from fastcifar.core.environment import environment_problem

    assert "asks for more than 1024 threads" in environment_problem({"OMP_NUM_THREADS": "100000"})


@pytest.mark.slow  # five trainer start-ups, torch imported in each: 4-10 s apiece on 2 loaded cores
@pytest.mark.parametrize(
    "changes, message",
    [
        ({"MASTER_PORT": "abc"}, "MASTER_PORT must be a port number 1..65535, not 'abc'"),
        ({"MASTER_PORT": "99999"}, "MASTER_PORT must be a port number 1..65535, not '99999'"),
        ({"RANK": "3"}, "RANK 3, LOCAL_RANK 0, WORLD_SIZE 2"),
        ({"WORLD_SIZE": "-2"}, "WORLD_SIZE must lie in 1..1,048,576, not '-2'"),
        ({"MASTER_ADDR": None}, "environment variable MASTER_ADDR expected, but not set"),
    ],
)
def test_a_bad_torchrun_environment_is_one_line_not_torchs_traceback(changes, message, tmp_path):
    e = {**env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    e.update({k: v for k, v in changes.items() if v is not None})
    for k in [k for k, v in changes.items() if v is None]:
        del e[k]
    proc = subprocess.run(
        [sys.executable, "-m", "fastcifar.train", "--data", str(tmp_path), *SHORT, "--dist-timeout-s", "5"],
        cwd=ROOT,
        env=e,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    line = one_line_error(proc.stderr)
    assert line.startswith("fastcifar: error: bad torchrun environment: ") and message in line, line


def test_a_home_that_does_not_exist_gets_no_folders_made_the_cache_is_skipped(tmp_path, monkeypatch):
    """The data's own folder not writable (a shared read-only copy), HOME a path that is not there:
    no folder is made anywhere, the images are decoded and the run goes on, with a note."""
    from fastcifar.data import folder as folder_module
    from fastcifar.data import load_dataset

    root, _ = write_image_folder(tmp_path / "data", n_train=20, n_test=10)
    home = tmp_path / "no" / "such" / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(folder_module.os, "access", lambda *a, **k: False)  # root ignores modes: say it
    lines = []
    ds = load_dataset(root, log=lines.append)
    assert len(ds.train_labels) == 20
    assert not (tmp_path / "no").exists()
    assert any(line.startswith("note: no decode cache: HOME ") for line in lines), lines
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # not absolute: ignored, as the XDG spec says
    assert folder_module.default_cache_dir()[0] is None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert folder_module.default_cache_dir()[0] == tmp_path / "fastcifar"


def test_a_missing_home_sends_tritons_cache_to_a_temporary_folder_on_a_gpu(tmp_path, monkeypatch):
    """Triton would ``os.makedirs`` $HOME/.triton/cache from / down; only where it compiles (CUDA)."""
    from fastcifar.core import environment

    monkeypatch.setenv("HOME", str(tmp_path / "no" / "home"))
    monkeypatch.delenv("TRITON_HOME", raising=False)
    assert environment.place_triton_cache("cpu") == "" and "TRITON_HOME" not in os.environ
    note = environment.place_triton_cache("cuda")
    folder = Path(os.environ["TRITON_HOME"])
    assert note.startswith("note: HOME ") and str(folder) in note and folder.is_dir()
    folder.rmdir()
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("TRITON_HOME")
    assert environment.place_triton_cache("cuda") == "" and "TRITON_HOME" not in os.environ
    assert not (tmp_path / "no").exists()


def test_fp16_on_the_cpu_is_refused_before_anything_is_written(tmp_path, capfd):
    from fastcifar.train import main as train_main

    data, _ = write_official(tmp_path / "data")
    out = tmp_path / "runs"
    code = train_main([*map(str, ["--data", data, *SHORT, "--precision", "fp16", "--out-dir", out])])
    line = one_line_error(capfd.readouterr().err)
    assert code == 2 and line.startswith(
        "fastcifar: error: --precision fp16 on the CPU runs half precision in software"
    )
    assert not run_dirs(out)


# --- minor ------------------------------------------------------------------------------------


def test_the_run_folder_name_never_leaves_out_dir(tmp_path):
    from fastcifar.core.config import Config
    from fastcifar.run.report import RunLog

    log = RunLog(Config(preset="../../x\ny"), str(tmp_path), True)
    log._make_dir()
    log._close()
    (made,) = tmp_path.iterdir()
    assert made.name.endswith("-_.._x_y") and made.parent == tmp_path


def test_the_lost_contact_line_carries_no_source_paths():
    from fastcifar.parallel import distributed

    exc = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500"
    )
    assert distributed.is_comm_failure(exc)
    line = distributed.failure_message(exc, 30)
    assert line.endswith("--dist-timeout-s 30): Connection closed by peer [127.0.0.1]:29500"), line
    assert ".cc" not in line and "/pytorch/" not in line


def test_predict_reads_tif_tiff_and_the_first_frame_of_a_gif(model_file, tmp_path, capsys):
    rng = np.random.default_rng(2)
    frames = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(3)]
    frames[0].save(tmp_path / "a.tif")
    frames[1].save(tmp_path / "b.TIFF")
    frames[0].save(tmp_path / "c.gif", save_all=True, append_images=frames[1:])
    code, err, out = command("predict", [model_file, tmp_path, "--json"], capsys)
    assert code == 0 and err == ""
    preds = {Path(p["path"]).name: p["top"] for p in json.loads(out)["predictions"]}
    assert set(preds) == {"a.tif", "b.TIFF", "c.gif"}
    from fastcifar.predict import read_image

    first = np.asarray(Image.open(tmp_path / "c.gif").convert("RGB"))
    assert np.array_equal(read_image(tmp_path / "c.gif")[0], first)  # frame 0, palette-quantized as saved


def test_an_export_whose_path_appears_meanwhile_does_not_overwrite_it(model_file, tmp_path, capsys, monkeypatch):
    """Two exports to one new path: the one that finds the path taken at its rename is refused
    (the kernel's link decides), and the other's whole file stays."""
    pytest.importorskip("onnx", reason="onnx is not installed (pip install -e '.[onnx]')")
    from fastcifar import export

    out = tmp_path / "m.onnx"
    real = export.onnx_bytes

    def competitor_first(*args, **kwargs):
        blob = real(*args, **kwargs)
        out.write_bytes(b"the other export's file")  # the other export renamed its file in meanwhile
        return blob

    monkeypatch.setattr(export, "onnx_bytes", competitor_first)
    code, err, _ = command("export", [model_file, "--onnx", out], capsys)
    assert code == 2 and one_line_error(err) == f"fastcifar: error: {out} exists; pass --force to overwrite it"
    assert out.read_bytes() == b"the other export's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


@pytest.mark.slow
def test_two_exports_to_one_new_path_at_once_one_wins_whole(model_file, tmp_path):
    onnx = pytest.importorskip("onnx", reason="onnx is not installed (pip install -e '.[onnx]')")
    out = tmp_path / "m.onnx"
    cmd = [sys.executable, "-m", "fastcifar", "export", str(model_file), "--onnx", str(out)]
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert sorted(code for code, _ in results) == [0, 2], results
    (loser,) = [err for code, err in results if code == 2]
    assert one_line_error(loser) == f"fastcifar: error: {out} exists; pass --force to overwrite it"
    onnx.checker.check_model(onnx.load(str(out)))  # whole and valid
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
