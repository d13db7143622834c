"""Official CIFAR-10 and CIFAR-100: the python-pickle batches, as a folder or release archive, and their download.

CIFAR-10 (``cifar-10-python.tar.gz``, 170,498,071 bytes) holds ``cifar-10-batches-py/`` with
``data_batch_1..5`` (10,000 images each), ``test_batch`` and ``batches.meta``. CIFAR-100
(``cifar-100-python.tar.gz``, 169,001,437 bytes) holds ``cifar-100-python/`` with ``train``
(50,000 images), ``test`` (10,000) and ``meta``; each image has a fine label (100 classes, used
here) and a coarse one (20 superclasses). Each batch is a pickled dict: ``data`` a (N, 3072) uint8
array, one image per row as three 32x32 planes (R, G, B), and the labels as a list of ints. The
pickles are unpickled with an allow-list, not ``pickle.load``, because a pickle can run arbitrary
code and these files come from the network.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import os
import pickle
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fastcifar.core.errors import DataError
from fastcifar.core.readfile import check_regular, hash_file, read_regular, why
from fastcifar.data.dataset import CIFAR10_CLASSES, Dataset


@dataclass(frozen=True)
class OfficialSet:
    """One official release: where it is fetched from, and how its folder is laid out."""

    name: str  # as --download-set spells it
    title: str  # for messages
    archive: str
    url: str
    md5: str
    folder: str  # the folder inside the archive
    train: tuple[str, ...]  # training batch files
    test: str
    meta: str  # holds the class names
    label_key: str
    names_key: str
    num_classes: int = 10  # labels lie in 0..num_classes-1


CIFAR10 = OfficialSet(
    "cifar10",
    "CIFAR-10",
    "cifar-10-python.tar.gz",
    "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    "c58f30108f718f92721af3b95e74349a",
    "cifar-10-batches-py",
    tuple(f"data_batch_{i}" for i in range(1, 6)),
    "test_batch",
    "batches.meta",
    "labels",
    "label_names",
)
CIFAR100 = OfficialSet(
    "cifar100",
    "CIFAR-100",
    "cifar-100-python.tar.gz",
    "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
    "eb9058c3a382ffc7106e4002c42a8d85",
    "cifar-100-python",
    ("train",),
    "test",
    "meta",
    "fine_labels",
    "fine_label_names",
    100,
)
OFFICIAL_SETS = {s.name: s for s in (CIFAR10, CIFAR100)}

# What a CIFAR batch pickle may reference: numpy's array reconstruction (and bytes), nothing else.
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("_codecs", "encode"),  # how a protocol-2 pickle written by Python 3 stores bytes
}


class _BatchUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _unpickle(raw: bytes, where: str, title: str) -> dict:
    try:
        batch = _BatchUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as exc:  # truncated, corrupt or hostile: all are bad input here
        raise DataError(f"{where}: not a readable {title} batch ({type(exc).__name__}: {exc})") from None
    if not isinstance(batch, dict):
        raise DataError(f"{where}: not a {title} batch (a {type(batch).__name__}, expected a dict)")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}


def decode_batch(raw: bytes, where: str, spec: OfficialSet = CIFAR10) -> tuple[np.ndarray, np.ndarray]:
    """One pickled batch -> (images (N, 32, 32, 3) uint8, labels (N,) int64)."""
    batch = _unpickle(raw, where, spec.title)
    if "data" not in batch or spec.label_key not in batch:
        raise DataError(f"{where}: {spec.title} batch without 'data' and '{spec.label_key}' entries")
    data = np.asarray(batch["data"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DataError(f"{where}: images must be uint8 rows of 3072 values (32x32 RGB), got {data.dtype} {data.shape}")
    labels = _labels(batch[spec.label_key], where, spec)
    if labels.shape != (data.shape[0],):
        raise DataError(f"{where}: {data.shape[0]} images but {labels.size} labels")
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # planes -> NHWC
    return np.ascontiguousarray(images), labels


def _labels(raw, where: str, spec: OfficialSet) -> np.ndarray:
    """The labels as int64, refused (DataError naming the file) unless each is an integer (a
    Python int or a numpy integer, not a bool, float or string) in 0..num_classes-1: a float label
    was once truncated and a string one converted, silently."""
    if isinstance(raw, np.ndarray):
        ok = raw.ndim == 1 and raw.dtype.kind in "iu"
    else:
        ok = isinstance(raw, (list, tuple)) and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in raw
        )
    if not ok:
        kinds = (
            sorted({type(v).__name__ for v in raw})
            if isinstance(raw, (list, tuple))
            else [f"{type(raw).__name__} of {raw.dtype}" if isinstance(raw, np.ndarray) else type(raw).__name__]
        )
        raise DataError(f"{where}: labels must be a list of integers, got {', '.join(kinds[:3])}")
    labels = np.asarray([int(v) for v in raw] if not isinstance(raw, np.ndarray) else raw)
    if labels.size and (labels.min() < 0 or labels.max() >= spec.num_classes):
        bad = labels[(labels < 0) | (labels >= spec.num_classes)][0]
        raise DataError(
            f"{where}: labels outside 0..{spec.num_classes - 1} (one is {bad}; {spec.title} has "
            f"{spec.num_classes} classes)"
        )
    return labels.astype(np.int64)


def _class_names(read, source: str, spec: OfficialSet) -> tuple[str, ...]:
    """CIFAR-10's fixed names; CIFAR-100's from its ``meta`` file (100 fine label names)."""
    if spec is CIFAR10:
        return CIFAR10_CLASSES
    meta = _unpickle(read(spec.meta), f"{source}/{spec.meta}", spec.title)
    names = meta.get(spec.names_key)
    if not isinstance(names, list) or not names:
        raise DataError(f"{source}/{spec.meta}: no '{spec.names_key}' list of class names")
    return tuple(n.decode() if isinstance(n, bytes) else str(n) for n in names)


def _assemble(read, source: str, spec: OfficialSet = CIFAR10) -> Dataset:
    """Build the data set from ``read(name) -> bytes`` for each batch name."""
    train = [decode_batch(read(name), f"{source}/{name}", spec) for name in spec.train]
    test_images, test_labels = decode_batch(read(spec.test), f"{source}/{spec.test}", spec)
    return Dataset(
        np.concatenate([t[0] for t in train]),
        np.concatenate([t[1] for t in train]),
        test_images,
        test_labels,
        _class_names(read, source, spec),
        source,
    ).validate()


def is_file_like(path: Path) -> bool:
    """There and not a folder: a regular file, or a FIFO, device or broken link that the reader
    then refuses by name (``is_file`` would skip it, and the batch would be called missing)."""
    return os.path.lexists(path) and not path.is_dir()


def set_of_folder(path: Path) -> OfficialSet | None:
    """The official set whose extracted folder ``path`` is, by name or by its files."""
    for spec in OFFICIAL_SETS.values():
        # exists, not is_file: a batch that is a FIFO or a device is refused by name when read
        if path.name == spec.folder or all(is_file_like(path / name) for name in (*spec.train, spec.test)):
            return spec
    return None


def check_input(path: Path, what: str) -> None:
    """An input file that is missing, unreadable or not a regular file: one line with the OS's
    reason, not the "corrupt archive" a failed read would look like."""
    try:
        check_regular(path)
    except OSError as exc:
        raise DataError(f"{path}: cannot read {what}: {why(exc)}") from None


def read_batch_dir(path: Path) -> Dataset:
    """Read an extracted ``cifar-10-batches-py`` or ``cifar-100-python`` folder."""
    spec = set_of_folder(path) or CIFAR10

    def read(name: str) -> bytes:
        f = path / name
        try:
            return read_regular(f)  # a FIFO or /dev/zero is refused by its type, never read
        except FileNotFoundError:
            raise DataError(f"{path}: missing {spec.title} batch file {name!r}") from None
        except OSError as exc:
            raise DataError(f"{f}: cannot read {spec.title} batch file: {why(exc)}") from None

    return _assemble(read, str(path), spec)


def read_archive(path: Path) -> Dataset:
    """Read a release archive directly, without extracting it to disk."""
    check_input(path, "archive")
    try:
        with tarfile.open(path, "r:gz") as tar:
            files = [m for m in tar.getmembers() if m.isfile()]
            spec = next(
                (s for s in OFFICIAL_SETS.values() if any(Path(m.name).parent.name == s.folder for m in files)), CIFAR10
            )
            members = {Path(m.name).name: m for m in files if Path(m.name).parent.name == spec.folder}

            def read(name: str) -> bytes:
                if name not in members:
                    raise DataError(f"{path}: archive has no {spec.folder}/{name}")
                return tar.extractfile(members[name]).read()

            return _assemble(read, str(path), spec)
    except DataError:
        raise
    except Exception as exc:  # tarfile, gzip, zlib and EOF errors all mean a damaged archive
        raise DataError(f"{path}: truncated or corrupt archive ({type(exc).__name__}: {exc})") from None


def fetch_by_hand(root: Path, spec: OfficialSet = CIFAR10) -> str:
    """How to do the download's work by hand, for an error message."""
    return (
        f"fetch {spec.url} by hand (MD5 {spec.md5}) and put {spec.archive} "
        f"in {root}{'' if str(root).endswith('/') else '/'}"
    )


def _missing_folders(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def download(root: Path, progress=print, spec: OfficialSet = CIFAR10) -> Path:
    """Fetch the release archive of ``spec`` into ``root`` and verify its MD5; returns its path.

    urllib fetches (with a progress bar on a terminal); the MD5 is checked after the fetch. It
    writes into a temporary folder inside ``root``, renamed into place only once the checksum
    matched, so an interrupted or corrupted download never leaves a file that looks finished. An
    archive already there with the right checksum is kept. A failed download says how to fetch the
    archive by hand and removes the folders it made for it (when still empty), so no empty
    ``data/`` is left to puzzle the next run.
    """
    made = _missing_folders(root)
    root.mkdir(parents=True, exist_ok=True)
    try:
        return _fetch(root, progress, spec)
    except BaseException:  # also an interrupt: the folders this call made go, if still empty
        for folder in made:
            try:
                folder.rmdir()
            except OSError:
                break
        raise


FETCH_TIMEOUT_S = 60  # a connection silent this long fails the download (one line), rather than hang the run
FETCH_BLOCK = 1 << 20  # bytes read and written at a time


def md5_of(path: Path) -> str:
    return hash_file(path, hashlib.md5(usedforsecurity=False))  # an integrity check against the published sum


def _get(url: str, dest: Path) -> None:
    """``url`` into ``dest`` (urllib: the address as given, never retried over another scheme), with a
    progress bar on a terminal (the CIFAR-10 archive is 170 MB)."""
    with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response, open(dest, "wb") as out:
        total = int(response.headers.get("Content-Length") or 0) or None
        with tqdm(
            total=total, unit="B", unit_scale=True, desc=dest.name, leave=False, disable=not sys.stderr.isatty()
        ) as bar:
            for block in iter(lambda: response.read(FETCH_BLOCK), b""):
                out.write(block)
                bar.update(len(block))


def _fetch(root: Path, progress, spec: OfficialSet) -> Path:
    url, md5 = spec.url, spec.md5
    target = root / spec.archive
    if target.is_file():
        if md5_of(target) == md5:
            return target
        raise DataError(f"{target}: checksum mismatch (expected MD5 {md5}); delete it to download again")
    progress(f"downloading {url} -> {target}")
    staging = tempfile.mkdtemp(prefix=f".{spec.archive}.", suffix=".part", dir=root)
    try:
        fetched = Path(staging) / spec.archive
        try:  # the MD5 is checked below: a mismatch then reads apart from a failed fetch
            _get(url, fetched)
        except (OSError, ValueError, http.client.HTTPException) as exc:  # URLError, timeouts: OSErrors
            raise DataError(f"download of {url} failed: {exc}; {fetch_by_hand(root, spec)}") from None
        if md5_of(fetched) != md5:
            raise DataError(f"{url}: checksum mismatch (expected MD5 {md5}); {fetch_by_hand(root, spec)}")
        os.replace(fetched, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
