"""Small CIFAR-10 look-alikes in every on-disk format the trainer reads, written by the tests.

The images are learnable: each class is a fixed blocky colour pattern plus noise, so a short CPU
run can show that training learns (accuracy far above the 10% of guessing).
"""

from __future__ import annotations

import os

import torch

# Triton decides between compiler and interpreter when a kernel is defined: switch the interpreter
# on before any test imports triton, so the kernel tests run on machines without a GPU (CI).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pickle
import signal
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastcifar.core.environment import usable_cores


def _share_the_cores() -> None:
    """pytest-xdist's workers share the machine's cores: each worker's torch takes its share of threads
    (cores // workers, at least 1) instead of a thread per core each. On CI's 2 cores with 2 workers,
    torch's default (2 threads each, 4 spinning on 2 cores) made the in-process compute of
    tests/unit/test_optim.py + tests/kernels/test_kernel_bn_act_pool.py 163 s against 130 s at one
    thread each (2026-12-07, this repository's 2-core machine). The commands tests start already run
    with OMP_NUM_THREADS=1 (tests/helpers/cli.py). Tests that compare with them bit for bit set one
    thread themselves (tests/helpers/models.py), so this changes no result, only contention."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, usable_cores() // workers))


_share_the_cores()

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
SHARED_JPEG = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "cifar10-jpeg.tar.gz"


def make_images(n: int, seed: int, noise: float = 40.0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images (N, 32, 32, 3) uint8 and labels cycling through the 10 classes."""
    templates = np.random.default_rng(1234).integers(0, 256, (10, 4, 4, 3)).astype(np.float32)
    templates = templates.repeat(8, axis=1).repeat(8, axis=2)  # 8x8 blocks: survive a 4-pixel shift
    rng = np.random.default_rng(seed)
    labels = np.arange(n, dtype=np.int64) % 10
    rng.shuffle(labels)
    images = templates[labels] + rng.normal(0, noise, (n, 32, 32, 3))
    return np.clip(images, 0, 255).astype(np.uint8), labels


def batch_bytes(images: np.ndarray, labels: np.ndarray, protocol: int = 2) -> bytes:
    """One batch pickled as the official release stores it (byte keys, planar rows)."""
    data = images.transpose(0, 3, 1, 2).reshape(len(images), -1)
    return pickle.dumps(
        {
            b"batch_label": b"synthetic",
            b"labels": [int(v) for v in labels],
            b"data": data,
            b"filenames": [b"x.png"] * len(labels),
        },
        protocol=protocol,
    )


def write_official(root: Path, per_batch: int = 40, n_test: int = 50) -> tuple[Path, dict]:
    """cifar-10-batches-py/ under ``root``; returns its path and the arrays written."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    train_x, train_y = make_images(5 * per_batch, seed=1)
    test_x, test_y = make_images(n_test, seed=2)
    for i in range(5):
        part = slice(i * per_batch, (i + 1) * per_batch)
        (folder / f"data_batch_{i + 1}").write_bytes(batch_bytes(train_x[part], train_y[part]))
    (folder / "test_batch").write_bytes(batch_bytes(test_x, test_y))
    (folder / "batches.meta").write_bytes(pickle.dumps({b"label_names": [c.encode() for c in CLASSES]}))
    return folder, {"train": (train_x, train_y), "test": (test_x, test_y)}


def tar_folder(src: Path, archive: Path, arcname: str) -> Path:
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(src, arcname=arcname)
    return archive


def write_image_folder(
    root: Path, n_train: int = 60, n_test: int = 30, fmt: str = "PNG", size: int = 32
) -> tuple[Path, dict]:
    """train/<class>/*.png and test/<class>/*.png (lossless, so decoding is exact)."""
    arrays = {}
    for split, n, seed in (("train", n_train, 3), ("test", n_test, 4)):
        images, labels = make_images(n, seed)
        for i, (img, lab) in enumerate(zip(images, labels, strict=True)):
            d = root / split / CLASSES[lab]
            d.mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).resize((size, size)).save(d / f"{i:05d}.{fmt.lower()}", format=fmt)
        arrays[split] = (images, labels)
    return root, arrays


def sort_by_label(images: np.ndarray, labels: np.ndarray):
    """Folder readers return images class by class; order the written arrays the same way."""
    order = np.argsort(labels, kind="stable")
    return images[order], labels[order]


def pytest_report_header(config):
    """The versions the suite runs with, one line at the top of every run (CI's log among them):
    scripts/versions.py, read from the packages' metadata."""
    from scripts.versions import line

    return line()


def pytest_collection_modifyitems(config, items):
    """The ``cuda`` marker's promise (pyproject.toml: "skipped without one"), kept here once: a test
    or parameter marked ``cuda`` is skipped on a machine without a GPU, such as CI's."""
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(no_gpu)


@pytest.fixture(autouse=True)
def _no_tf32():
    """fp32 parity tests compare fp32 with fp32: on CUDA, cuDNN convolutions default to TF32 (10-bit
    mantissa, ~1e-3 relative), which would fail them for the wrong reason. Off for every test."""
    if not torch.cuda.is_available():
        yield
        return
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(autouse=True)
def _signals_left_as_found(request):
    """A test leaves SIGINT's and SIGTERM's handlers and the blocked set as it found them: the
    commands later tests start would inherit an ignored or blocked signal, and a later test of
    Ctrl-C would fail far from the cause. The test that changed them fails here, by name, and the
    next test gets them back."""
    wanted = (signal.SIGINT, signal.SIGTERM)
    before = [signal.getsignal(s) for s in wanted], signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    after = [signal.getsignal(s) for s in wanted], signal.pthread_sigmask(signal.SIG_BLOCK, [])
    if after != before:
        for sig, handler in zip(wanted, before[0], strict=True):
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, before[1])
        pytest.fail(f"{request.node.nodeid} left the signal handlers or the blocked set changed: {before} -> {after}")


def uint8_images(n=6, size=32, seed=0) -> torch.Tensor:
    """``n`` random NHWC uint8 images (the layout tests' input)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, generator=g)


@pytest.fixture
def cuda_layouts(monkeypatch):
    """F.pad with CUDA's output layout: default (NCHW) contiguous whatever the input's strides.

    On CUDA, ``reflection_pad2d`` (and the constant pad) of an NCHW-shaped view of NHWC data returns
    NCHW-contiguous output, where the CPU keeps channels-last. Code that padded a permuted view and
    permuted back got contiguous NHWC on the CPU and a non-contiguous view on CUDA, and the Triton
    augmentation refuses that on the first batch. This fixture lays F.pad's output out as CUDA does,
    so the trap fails on the CPU instead of on a GPU (tests/unit/test_augment.py checks the emulation)."""
    import torch.nn.functional as F

    real_pad = F.pad

    def pad(x, *args, **kwargs):
        return real_pad(x, *args, **kwargs).contiguous()

    monkeypatch.setattr(F, "pad", pad)
    monkeypatch.setattr(torch.nn.functional, "pad", pad)


@pytest.fixture
def official_dir(tmp_path):
    return write_official(tmp_path / "data")


@pytest.fixture
def image_folder(tmp_path):
    return write_image_folder(tmp_path / "imgs")


@pytest.fixture
def learnable_data(tmp_path):
    """An official-format set big enough to learn from in a few CPU seconds."""
    folder, _ = write_official(tmp_path / "learn", per_batch=200, n_test=400)
    return folder


@pytest.fixture
def http_folder(tmp_path):
    """Serve a folder over HTTP on localhost (the download's stand-in for the network); yields
    (folder, base URL)."""
    import functools
    import http.server
    import threading

    root = tmp_path / "served"
    root.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def one_rank_group(tmp_path):
    """A 1-rank gloo group: gradient buckets and compression collectives really run, in this process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# Runs that several test files read (tests/helpers/models.py, cli.py), trained once per session:
# the checkpoint, evaluate, predict and resume tests share them. tests/cli/test_cli.py has a
# ``trained`` of its own (a plain run), which takes precedence there.
@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """A tiny `fast` run of 3 epochs that wrote a checkpoint after epoch 2, and its data."""
    from models import FAST_TINY, train_with_checkpoint

    return train_with_checkpoint(tmp_path_factory.mktemp("trained"), FAST_TINY)


@pytest.fixture(scope="session")
def trained_default(tmp_path_factory):
    """The same with the default preset (Muon's momentum on the filters)."""
    from models import DEFAULT_TINY, train_with_checkpoint

    return train_with_checkpoint(tmp_path_factory.mktemp("trained_default"), DEFAULT_TINY)


@pytest.fixture(scope="session")
def resume_data(tmp_path_factory):
    folder, _ = write_official(tmp_path_factory.mktemp("data"), per_batch=40, n_test=50)
    return folder


@pytest.fixture(scope="session")
def uninterrupted(resume_data, tmp_path_factory):
    """One 3-epoch run of resume_data with --val-split, a checkpoint after every epoch (the last, 2, kept)."""
    import json

    from cli import TINY, run_dirs, run_train

    out = tmp_path_factory.mktemp("runs")
    proc = run_train(["--data", resume_data, "--out-dir", out, *TINY, "--val-split", "40", "--checkpoint-every", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = run_dirs(out)
    return {"dir": run_dir, "stdout": proc.stdout, "summary": json.loads((run_dir / "summary.json").read_text())}


def one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{stderr}"
    assert "Traceback" not in stderr
    return lines[0]
