"""Official CIFAR-10: the python-pickle batches, as a folder or as the release archive, and its download.

The release (``cifar-10-python.tar.gz``, 170,498,071 bytes) holds ``cifar-10-batches-py/`` with
``data_batch_1..5`` (10,000 images each), ``test_batch`` and ``batches.meta``. Each batch is a
pickled dict: ``data`` a (10000, 3072) uint8 array, one image per row as three 32x32 planes (R, G, B);
``labels`` a list of ints. The pickles are unpickled with an allow-list, not ``pickle.load``, because a
pickle can run arbitrary code and these files come from the network.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import tarfile
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from .dataset import CIFAR10_CLASSES, Dataset
from .errors import DataError

ARCHIVE_NAME = "cifar-10-python.tar.gz"
ARCHIVE_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
ARCHIVE_MD5 = "c58f30108f718f92721af3b95e74349a"
BATCH_DIR = "cifar-10-batches-py"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"

# What a CIFAR batch pickle may reference: numpy's array reconstruction (and bytes), nothing else.
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("_codecs", "encode"),  # how a protocol-2 pickle written by Python 3 stores bytes
}


class _BatchUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def decode_batch(raw: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    """One pickled batch -> (images (N, 32, 32, 3) uint8, labels (N,) int64)."""
    try:
        batch = _BatchUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as exc:  # truncated, corrupt or hostile: all are bad input here
        raise DataError(f"{where}: not a readable CIFAR-10 batch ({type(exc).__name__}: {exc})") from None
    if not isinstance(batch, dict):
        raise DataError(f"{where}: not a CIFAR-10 batch (a {type(batch).__name__}, expected a dict)")
    batch = {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}
    if "data" not in batch or "labels" not in batch:
        raise DataError(f"{where}: CIFAR-10 batch without 'data' and 'labels' entries")
    data = np.asarray(batch["data"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DataError(f"{where}: images must be uint8 rows of 3072 values (32x32 RGB), "
                        f"got {data.dtype} {data.shape}")
    labels = np.asarray(batch["labels"], dtype=np.int64)
    if labels.shape != (data.shape[0],):
        raise DataError(f"{where}: {data.shape[0]} images but {labels.size} labels")
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # planes -> NHWC
    return np.ascontiguousarray(images), labels


def _assemble(read, source: str) -> Dataset:
    """Build the data set from ``read(name) -> bytes`` for each batch name."""
    train = [decode_batch(read(name), f"{source}/{name}") for name in TRAIN_BATCHES]
    test_images, test_labels = decode_batch(read(TEST_BATCH), f"{source}/{TEST_BATCH}")
    return Dataset(np.concatenate([t[0] for t in train]), np.concatenate([t[1] for t in train]),
                   test_images, test_labels, CIFAR10_CLASSES, source).validate()


def read_batch_dir(path: Path) -> Dataset:
    """Read an extracted ``cifar-10-batches-py`` folder."""
    def read(name: str) -> bytes:
        f = path / name
        if not f.is_file():
            raise DataError(f"{path}: missing CIFAR-10 batch file {name!r}")
        return f.read_bytes()
    return _assemble(read, str(path))


def read_archive(path: Path) -> Dataset:
    """Read the release archive directly, without extracting it to disk."""
    try:
        with tarfile.open(path, "r:gz") as tar:
            members = {Path(m.name).name: m for m in tar.getmembers()
                       if m.isfile() and Path(m.name).parent.name == BATCH_DIR}

            def read(name: str) -> bytes:
                if name not in members:
                    raise DataError(f"{path}: archive has no {BATCH_DIR}/{name}")
                return tar.extractfile(members[name]).read()
            return _assemble(read, str(path))
    except DataError:
        raise
    except Exception as exc:  # tarfile, gzip, zlib and EOF errors all mean a damaged archive
        raise DataError(f"{path}: truncated or corrupt archive ({type(exc).__name__}: {exc})") from None


def md5_of(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download(root: Path, url: str = ARCHIVE_URL, md5: str = ARCHIVE_MD5, progress=print) -> Path:
    """Fetch the release archive into ``root`` and verify its MD5; returns the archive's path.

    An archive already there with the right checksum is kept. The download goes to a temporary
    file in ``root`` that is renamed only once its checksum matches, so an interrupted or
    corrupted download never leaves a file that looks finished.
    """
    root.mkdir(parents=True, exist_ok=True)
    target = root / ARCHIVE_NAME
    if target.is_file():
        if md5_of(target) == md5:
            return target
        raise DataError(f"{target}: checksum mismatch (expected MD5 {md5}); delete it to download again")
    progress(f"downloading {url} -> {target}")
    fd, tmp = tempfile.mkstemp(prefix=f".{ARCHIVE_NAME}.", suffix=".part", dir=root)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=60) as response:
            total = int(response.headers.get("Content-Length") or 0)
            done, next_report = 0, 0.1
            for block in iter(lambda: response.read(1 << 20), b""):
                out.write(block)
                done += len(block)
                if total and done / total >= next_report:
                    progress(f"  {done / 1e6:.0f} of {total / 1e6:.0f} MB")
                    next_report += 0.1
        got = md5_of(Path(tmp))
        if got != md5:
            raise DataError(f"{url}: checksum mismatch (MD5 {got}, expected {md5})")
        os.replace(tmp, target)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise DataError(f"download of {url} failed: {exc}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
