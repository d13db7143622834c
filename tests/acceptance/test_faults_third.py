"""Faults, round three: a signal during a heavy import, an output onto its input, config files and
launcher variables that crashed the reader, TensorBoard in the way, data that said nothing, model
files from elsewhere. Each case ends in one line and a documented exit status, or the run goes on
and says why; never a traceback, and never a file overwritten that was read."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli import ROOT, TINY, as_a_shell_starts_it, env, run_dirs
from conftest import one_line_error, write_image_folder, write_official
from models import tiny_model_file


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    return tiny_model_file(tmp_path_factory.mktemp("model") / "model.safetensors")


def command(name: str, argv, capsys) -> tuple[int, str, str]:
    """``fastcifar NAME ARGV`` in this process: (exit status, stderr, stdout); never a traceback."""
    from fastcifar import cli

    code = cli.main([name, *map(str, argv)])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.err, out.out


# --- a signal while an extension module initializes -------------------------------------------

# An "onnx" whose import takes as long as the test wants, and which does what pybind11's and
# nanobind's module initialization do with an exception raised inside it: turn it into ImportError
# (onnxruntime), or worse. "started" says the import has begun; it ends when "go" appears.
SLOW_ONNX = """\
import os, time
from pathlib import Path
here = Path(os.environ["SLOW_IMPORT_DIR"])
(here / "started").write_text("")
try:
    while not (here / "go").exists():
        time.sleep(0.01)
except BaseException as exc:
    raise ImportError(f"initialization failed: {exc!r}") from exc
(here / "finished").write_text("")
"""


def _no_signal_pending(pid: int) -> bool:
    """Whether the kernel has handed every signal sent to ``pid`` to a handler (/proc's SigPnd and
    ShdPnd: per thread and per process)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["SigPnd"], 16) == 0 and int(fields["ShdPnd"], 16) == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_an_extensions_import_is_taken_after_it(sig, model_file, tmp_path):
    """Ctrl-C while export imports onnx: the import finishes undisturbed, then the run stops with
    the interruption's line and 128 + the signal, not "cannot be imported" (exit 2) or a crash."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc to see that the signal was delivered")
    fake = tmp_path / "site"
    (fake / "onnx").mkdir(parents=True)
    (fake / "onnx" / "__init__.py").write_text(SLOW_ONNX)
    sync = tmp_path / "sync"
    sync.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    e = {**env(), "PYTHONPATH": f"{fake}{os.pathsep}{ROOT}", "SLOW_IMPORT_DIR": str(sync)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastcifar.export", str(model_file), "--onnx", str(out / "m.onnx")],
        cwd=ROOT,
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_a_shell_starts_it,
    )
    deadline = time.monotonic() + 120
    while not (sync / "started").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (sync / "started").exists(), proc.communicate(timeout=60)[1][-3000:]
    proc.send_signal(sig)
    while not _no_signal_pending(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    (sync / "go").write_text("")  # the handler has run by now, at the import's next bytecode
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert one_line_error(err) == f"fastcifar: interrupted by {signal.Signals(sig).name}"
    assert (sync / "finished").exists(), "the import was left to finish"
    assert list(out.iterdir()) == []


# --- an output onto an input -----------------------------------------------------------------

# The commands that write a file, with their arguments ({f}: the model file, {out}: the output)
WRITERS = [
    ("export", ["{f}", "--onnx", "{out}"]),
    ("export", ["{f}", "--onnx", "{out}", "--force"]),
    ("checkpoint", ["seal", "{f}", "--out", "{out}"]),
    ("checkpoint", ["restore", "{f}", "{f}", "--out", "{out}"]),
]


@pytest.mark.parametrize("how", ["same path", "hard link", "symlink"])
@pytest.mark.parametrize("name, argv", WRITERS)
def test_no_command_writes_its_output_onto_its_input(name, argv, how, model_file, tmp_path, capsys):
    model = tmp_path / "model.safetensors"
    model.write_bytes(model_file.read_bytes())
    before = model.read_bytes()
    out = {"same path": model, "hard link": tmp_path / "link.safetensors", "symlink": tmp_path / "sym.onnx"}[how]
    if how == "hard link":
        os.link(model, out)
    elif how == "symlink":
        out.symlink_to(model)
    code, err, _ = command(name, [a.format(f=model, out=out) for a in argv], capsys)
    assert code == 2
    assert one_line_error(err).endswith(f"{out} is the input {model}; write the output to another file")
    assert model.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({model.name, out.name})


@pytest.mark.parametrize("name, argv", WRITERS)
def test_every_command_refuses_an_output_in_a_missing_folder_and_makes_none(name, argv, model_file, tmp_path, capsys):
    out = tmp_path / "typo" / "out.file"
    code, err, _ = command(name, [a.format(f=model_file, out=out) for a in argv], capsys)
    assert code == 2
    assert one_line_error(err) == f"fastcifar: error: {tmp_path / 'typo'}: no such folder (make it first)"
    assert not (tmp_path / "typo").exists()


# --- config files that crashed the reader ----------------------------------------------------


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"preset": ["fast"]}', "preset must be a preset's name (a string), not an array"),
        ('{"preset": {"name": "fast"}}', "preset must be a preset's name (a string), not an object"),
        ('{"preset": 3}', "preset must be a preset's name (a string), not a number"),
        ("[" * 200_000 + "]" * 200_000, "not a JSON file of settings (nested too deeply)"),
        ('{"epochs": ' + "{" * 200_000, "not a JSON file of settings"),
    ],
)
def test_a_config_file_that_crashed_the_reader_is_one_line(content, message, tmp_path, capsys):
    from fastcifar.core.options import parse_command_line

    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(SystemExit) as stop:
        parse_command_line(["--config", str(path)])
    assert stop.value.code == 2
    line = one_line_error(capsys.readouterr().err)
    assert line.startswith(f"fastcifar: error: --config {path}: {message}"), line


def test_a_huge_config_file_is_refused_by_its_size_before_it_is_read(tmp_path, capsys, monkeypatch):
    from fastcifar.core import readfile
    from fastcifar.core.options import parse_command_line

    path = tmp_path / "config.json"
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # 1 GiB, sparse: no disk used
    reads = []
    real_fdopen = os.fdopen

    def counted(fd, *args, **kwargs):
        f = real_fdopen(fd, *args, **kwargs)
        real_read = f.read
        f.read = lambda n=-1: reads.append(n) or real_read(n)
        return f

    monkeypatch.setattr(readfile.os, "fdopen", counted)
    with pytest.raises(SystemExit):
        parse_command_line(["--config", str(path)])
    line = one_line_error(capsys.readouterr().err)
    want = f"fastcifar: error: --config {path}: 1,073,741,824 bytes, more than the 1,048,576 it may have"
    assert line.startswith(want), line
    assert reads == [], "refused by its size, not read"


# --- launcher variables out of range ---------------------------------------------------------

SRUN_TASK = {
    "SLURM_JOB_ID": "12345",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_NUM_NODES": "1",
}


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"WORLD_SIZE": "100000000000000000000"}, "WORLD_SIZE must lie in 1..1,048,576, not '100000000000000000000'"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE must lie in 1..1,048,576, not '0'"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE must be a whole number, not 'two'"),
        ({"WORLD_SIZE": "\u0662"}, "WORLD_SIZE must be a whole number, not '\u0662'"),  # an Arabic-Indic 2
        ({"WORLD_SIZE": "1" * 400}, "WORLD_SIZE must be a whole number, not '" + "1" * 400 + "'"),
        ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK must lie in 0..1,048,576, not '-1'"),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "99999999999"}, "LOCAL_RANK must lie in 0..1,048,576, not '99999999999'"),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "2"}, "RANK 0, LOCAL_RANK 2, WORLD_SIZE 2 (RANK and LOCAL_RANK must lie"),
    ],
)
def test_torchruns_variables_are_range_checked_before_any_process_group(changes, message, monkeypatch):
    from fastcifar.core.errors import ConfigError
    from fastcifar.parallel import distributed

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in changes.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda *a, **k: pytest.fail("a group was formed"))
    with pytest.raises(ConfigError) as refused:
        distributed.setup("cpu")
    assert str(refused.value).startswith("bad torchrun environment: " + message), refused.value


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"SLURM_STEP_NUM_TASKS": "100000000000000000000"}, "SLURM_STEP_NUM_TASKS must lie in 1..1,048,576"),
        ({"SLURM_STEP_NUM_TASKS": "-3"}, "SLURM_STEP_NUM_TASKS must lie in 1..1,048,576, not '-3'"),
        ({"SLURM_STEP_NUM_TASKS": "x"}, "SLURM_STEP_NUM_TASKS must be a whole number, not 'x'"),
        ({"SLURM_PROCID": "7"}, "SLURM_PROCID '7' is not below SLURM_STEP_NUM_TASKS 2"),
        ({"SLURM_LOCALID": "-1"}, "SLURM_LOCALID must lie in 0..1,048,576, not '-1'"),
        ({"SLURM_STEP_NUM_NODES": "\u00b2"}, "SLURM_STEP_NUM_NODES must be a whole number, not '\u00b2'"),
    ],
)
def test_srun_task_counts_are_range_checked_in_one_line(changes, message):
    from fastcifar.core.errors import ConfigError
    from fastcifar.parallel.distributed import slurm_environment

    with pytest.raises(ConfigError) as refused:
        slurm_environment({**SRUN_TASK, **changes})
    assert str(refused.value).startswith("bad srun environment: " + message), refused.value


# --- TensorBoard in the way ------------------------------------------------------------------


def test_tensorboard_that_cannot_write_is_one_line_and_the_run_goes_on(tmp_path, capfd, monkeypatch):
    """``tensorboard`` in the run folder is a file: one line says the logger is off and why, and
    the run ends as any other, with its summary.json."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install -e '.[tensorboard]')")
    from fastcifar.run import report
    from fastcifar.train import main as train_main

    real = report.RunLog._make_dir

    def with_a_file_in_the_way(self):
        real(self)
        (self.dir / "tensorboard").write_text("not a folder")

    monkeypatch.setattr(report.RunLog, "_make_dir", with_a_file_in_the_way)
    data, _ = write_official(tmp_path / "data")
    out = tmp_path / "runs"
    code = train_main([*TINY, "--epochs", "1", "--data", str(data), "--out-dir", str(out), "--tensorboard"])
    err = capfd.readouterr().err
    assert code == 0, err
    assert "Traceback" not in err
    (run_dir,) = run_dirs(out)
    notes = [line for line in err.splitlines() if "tensorboard" in line.lower()]
    assert notes == [
        f"fastcifar: note: --tensorboard is off for this run: cannot write {run_dir / 'tensorboard' / 'run1'}: "
        "Not a directory"
    ]
    assert (run_dir / "summary.json").is_file()
    assert (run_dir / "tensorboard").read_text() == "not a folder"


def test_tensorboard_in_a_folder_without_write_permission_is_one_line(tmp_path):
    """The same for a ``tensorboard/`` folder the user may not write (root ignores modes: the test
    drops that capability with setpriv, or is skipped)."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install -e '.[tensorboard]')")
    prefix = []
    if os.geteuid() == 0:
        caps = "-dac_override,-dac_read_search"
        prefix = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", "--"]
        try:
            subprocess.run([*prefix, sys.executable, "-c", "pass"], check=True, timeout=60, capture_output=True)
        except (OSError, subprocess.SubprocessError):
            pytest.skip("root, and setpriv cannot drop the capability that overrides file modes")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard").chmod(0o555)
    script = (
        "import sys, types\nfrom pathlib import Path\n"
        "from fastcifar.core.config import from_preset\nfrom fastcifar.run.tensorboard import TensorBoard\n"
        "tb = TensorBoard(from_preset('fast'), Path(sys.argv[1]), 1, 512, [10], {})\n"
        "tb.start(types.SimpleNamespace(seed=0))\n"
        "tb.epoch_done(0, types.SimpleNamespace(epoch=1, train_loss=1.0, test_loss=1.0, train_acc=0.5, "
        "test_acc=0.5, lr=0.1, train_time=1.0, test_time=1.0))\n"
        "tb.finish(None)\nprint('went on')\n"
    )
    try:
        proc = subprocess.run(
            [*prefix, sys.executable, "-c", script, str(tmp_path)],
            cwd=ROOT,
            env=env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        (tmp_path / "tensorboard").chmod(0o755)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "went on\n"
    assert one_line_error(proc.stderr) == (
        f"fastcifar: note: --tensorboard is off for this run: cannot write {tmp_path / 'tensorboard' / 'run1'}: "
        "Permission denied"
    )


# --- image folders that said nothing ---------------------------------------------------------


def test_an_image_folder_with_one_class_is_refused_in_one_line(tmp_path, capfd):
    from fastcifar.train import main as train_main

    folder, _ = write_image_folder(tmp_path / "data", n_train=20, n_test=10)
    for split in ("train", "test"):
        for cls in sorted((folder / split).iterdir())[1:]:
            for f in cls.iterdir():
                f.unlink()
            cls.rmdir()
    (only,) = [p.name for p in (folder / "train").iterdir()]
    out = tmp_path / "runs"
    assert train_main([*TINY, "--data", str(folder), "--out-dir", str(out)]) == 2
    assert one_line_error(capfd.readouterr().err) == (
        f"fastcifar: error: {folder}: one class folder under train/ ({only}); a classifier needs two or more"
    )
    assert not run_dirs(out)


def test_images_an_image_folder_skips_are_counted_and_named_also_from_the_cache(tmp_path):
    from fastcifar.data import load_dataset

    folder, arrays = write_image_folder(tmp_path / "data", n_train=20, n_test=10)
    cls = sorted((folder / "train").iterdir())[0]
    (cls / "more" / "deeper").mkdir(parents=True)
    for rel in ("more/a.png", "more/b.png", "more/deeper/c.png", "more/notes.txt"):
        (cls / rel).write_bytes((cls / sorted(os.listdir(cls))[0]).read_bytes() if rel.endswith(".png") else b"x")
    (folder / "test" / "stray.png").write_bytes(b"not read")
    (folder / "train" / "README.txt").write_text("not an image: not data, not counted")
    want = (
        f"note: {folder}: skipped 4 image files not directly in train/<class>/ or test/<class>/: "
        f"test/stray.png, train/{cls.name}/more/a.png, train/{cls.name}/more/b.png, ... (first 3)"
    )
    for _ in ("decoded", "from the cache"):
        lines = []
        ds = load_dataset(folder, cache_dir=tmp_path / "cache", log=lines.append)
        assert [line for line in lines if "skipped" in line] == [want]
        assert len(ds.train_labels) == len(arrays["train"][1]), "the skipped images are not read"


# --- model files from elsewhere --------------------------------------------------------------


def _state_and_meta(path: Path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    return load_file(str(path)), meta


@pytest.mark.parametrize("name", ["predict", "evaluate", "export"])
def test_a_plain_safetensors_file_says_what_it_lacks_and_how_to_proceed(name, model_file, tmp_path, capsys):
    from safetensors.torch import save_file

    tensors, _ = _state_and_meta(model_file)
    plain = tmp_path / "plain.safetensors"
    save_file(tensors, str(plain))
    argv = {"predict": [plain, tmp_path], "evaluate": [plain, "--data", tmp_path], "export": [plain, "--onnx", "x"]}
    code, err, _ = command(name, argv[name], capsys)
    assert code == 2
    assert one_line_error(err) == (
        f"fastcifar: error: {plain}: a plain safetensors file, not a fastcifar model file: its metadata lacks "
        "the keys a model file needs (format 'fastcifar.model/1', config, classes, mean, std); write the state "
        "dict with fastcifar.models.files.save_weights (docs/models.md), which records them and the digest "
        "(checkpoint seal adds only the digest)"
    )
    code, _, out = command("checkpoint", ["inspect", plain], capsys)
    assert code == 0 and "plain safetensors file (no fastcifar metadata)" in out, out


def test_the_way_the_plain_file_line_names_makes_a_model_file(model_file, tmp_path, capsys):
    from safetensors.torch import save_file

    from fastcifar.models.files import config_from_dict, save_weights

    tensors, meta = _state_and_meta(model_file)
    save_file(tensors, str(tmp_path / "plain.safetensors"))
    cfg = config_from_dict(json.loads(meta["config"]))
    save_weights(
        tmp_path / "model.safetensors", tensors, cfg, json.loads(meta["classes"]), None, [125.0] * 3, [60.0] * 3
    )
    assert command("checkpoint", ["inspect", tmp_path / "model.safetensors"], capsys)[0] == 0


def _rewritten(path: Path, out: Path, change) -> Path:
    """``path`` with its JSON header parsed, passed through ``change`` and written back compactly,
    padded with spaces to its old length (safetensors' own padding): the tensor bytes untouched."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = change(json.loads(blob[8 : 8 + n]))
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    out.write_bytes(blob[:8] + text.ljust(n) + blob[8 + n :])
    return out


def _reversed(header: dict) -> dict:
    meta = header["__metadata__"]
    return {**dict(reversed(header.items())), "__metadata__": dict(reversed(meta.items()))}


def test_a_model_file_whose_header_is_rewritten_in_another_order_is_refused(model_file, tmp_path, capsys):
    """The same header content in another order: every byte of the file is covered, so it is refused
    as any changed byte is; the original, and a rewrite that changes no byte, load."""
    from fastcifar.models.files import CheckpointError, load_model

    same = _rewritten(model_file, tmp_path / "same.safetensors", lambda h: h)
    assert same.read_bytes() == model_file.read_bytes(), "the rewrite itself changes nothing"
    load_model(same)
    moved = _rewritten(model_file, tmp_path / "moved.safetensors", _reversed)
    assert moved.read_bytes() != model_file.read_bytes()
    with pytest.raises(CheckpointError, match="its contents do not match the digest written with them"):
        load_model(moved)
    code, err, _ = command("predict", [moved, tmp_path], capsys)
    assert code == 2 and "do not match the digest" in one_line_error(err)


def test_a_model_file_sealed_with_the_content_digest_of_before_still_loads(model_file, tmp_path):
    from safetensors.torch import save

    from fastcifar.models.files import DIGEST_KEY, digest, load_model

    tensors, meta = _state_and_meta(model_file)
    meta = {k: v for k, v in meta.items() if k != DIGEST_KEY}
    older = tmp_path / "older.safetensors"
    older.write_bytes(save(tensors, metadata={**meta, DIGEST_KEY: digest(save(tensors, metadata=meta))}))
    net, info = load_model(older)
    assert info.classes and net is not None


def test_a_model_file_header_nested_thousands_deep_is_one_line(tmp_path, capsys):
    header = b"[" * 100_000 + b"]" * 100_000
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    code, err, _ = command("predict", [path, tmp_path], capsys)
    assert code == 2
    assert one_line_error(err).startswith(f"fastcifar: error: {path}: not a readable model file")
