"""Reading CIFAR in every layout the trainer accepts, and splitting it over ranks.

``load_dataset(path)`` recognizes, in this order:
  - an official release archive ``cifar-10-python.tar.gz`` or ``cifar-100-python.tar.gz`` (or a
    folder holding one);
  - an extracted ``cifar-10-batches-py/`` or ``cifar-100-python/`` folder (or a folder holding one);
  - an image folder ``train/<class>/*``, ``test/<class>/*`` (or its single subfolder), or a
    ``.tar.gz`` of one, decoded once and cached as uint8 arrays.
With ``download=True`` a path holding none of these gets the official archive of
``download_set`` (cifar10 | cifar100), MD5-checked. Without it, the error says how to get the data:
``--download`` where the command has it (``offer_download``), and how to fetch it by hand. The
class count is the data's: 10, 100, or an image folder's number of class folders.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import numpy as np

from fastcifar.core.errors import DataError
from fastcifar.core.readfile import kind, why
from fastcifar.data.dataset import CIFAR10_CLASSES, IMAGE_SHAPE, Dataset
from fastcifar.data.folder import (
    BatchDecoder,
    cache_path,
    decoder_name,
    find_split_root,
    load_cache,
    read_folder,
    read_folder_archive,
    save_cache,
)
from fastcifar.data.official import (
    OFFICIAL_SETS,
    check_input,
    download,
    fetch_by_hand,
    is_file_like,
    read_archive,
    read_batch_dir,
    set_of_folder,
)

__all__ = ["CIFAR10_CLASSES", "IMAGE_SHAPE", "DataError", "Dataset", "load_dataset", "rank_shard", "shard_indices"]

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")


def _cached(
    source: Path,
    cache_dir: Path | None,
    read: Callable[[Path, BatchDecoder | None], Dataset],
    decode: BatchDecoder | None,
    log,
    write: bool = True,
) -> Dataset:
    """``read(source, decode)``, through a cache keyed by the source and by the decoder; the cache
    is written only when ``write``."""
    target, note = cache_path(source, cache_dir, decoder_name(decode))
    if target is None:  # no place for a cache: ``note`` says why
        if write:
            log(note)
        log(f"decoding {source}")
        ds = read(source, decode)
        if ds.note:
            log(ds.note)
        return ds
    ds = load_cache(target, str(source))
    if ds is not None:
        if ds.note:  # said again on every start: the cache holds it
            log(ds.note)
        return ds
    log(f"decoding {source} once (cache: {target})")
    ds = read(source, decode)
    if ds.note:
        log(ds.note)
    if not write:
        return ds
    try:
        save_cache(target, ds)
    except OSError as exc:  # a read-only place costs speed next time, not this run
        log(f"note: could not write the cache {target}: {exc}")
    return ds


def _download(path: Path, log, download_set: str, write: bool) -> Dataset:
    if not write:  # another process of this node fetched it already; this one only reads
        raise DataError(
            f"{path}: still no data after local rank 0 of this node fetched it; "
            f"do all ranks of a node see the same --data?"
        )
    return read_archive(download(path, progress=log, spec=OFFICIAL_SETS[download_set]))


def _read_any_archive(path: Path, decode: BatchDecoder | None) -> Dataset:
    """An official release archive or a ``.tar.gz`` of an image folder, told apart by content."""
    try:
        with tarfile.open(path, "r:gz") as tar:
            members = tar.getmembers()
            official = any(
                spec.folder in PurePosixPath(m.name).parts for m in members for spec in OFFICIAL_SETS.values()
            )
            if not official:
                return read_folder_archive(path, tar, members, decode)
    except DataError:
        raise
    except Exception as exc:  # gzip/tar/EOF errors: a damaged or foreign file
        raise DataError(f"{path}: truncated or corrupt archive ({type(exc).__name__}: {exc})") from None
    return read_archive(path)


def load_dataset(
    path: str | Path,
    download_missing: bool = False,
    cache_dir: str | Path | None = None,
    log: Callable[[str], None] = print,
    decode: BatchDecoder | None = None,
    download_set: str = "cifar10",
    offer_download: bool = True,
    write: bool = True,
) -> Dataset:
    """Load CIFAR from ``path`` in any layout above; raise DataError on anything unusable (an
    OSError the readers do not name themselves included: one line with the path and the OS's reason).
    ``decode`` decodes an image folder's files in batches when no cache holds them (PIL when None,
    or for any batch it declines). ``offer_download``: the messages suggest ``--download`` (a
    command without that flag, such as evaluate, passes False). ``write=False``: read only, neither
    download nor write a cache (a rank whose node's local rank 0 did both already)."""
    path = Path(path).expanduser()
    spec = OFFICIAL_SETS.get(download_set, OFFICIAL_SETS["cifar10"])
    hint = (
        f"pass --download to fetch official {spec.title} there, or "
        if offer_download
        else f"for official {spec.title}, "
    ) + fetch_by_hand(path, spec)
    try:
        return _load(path, download_missing, cache_dir, log, decode, download_set, hint, write)
    except OSError as exc:
        raise DataError(f"{exc.filename or path}: {why(exc)}") from None


def _load(
    path: Path, download_missing: bool, cache_dir, log, decode, download_set: str, hint: str, write: bool
) -> Dataset:
    cache = Path(cache_dir).expanduser() if cache_dir else None
    if path.is_file():
        if not path.name.endswith(ARCHIVE_SUFFIXES):
            raise DataError(f"{path}: unknown layout (expected a .tar.gz archive or a folder)")
        check_input(path, "archive")
        return _cached(path, cache, _read_any_archive, decode, log, write)
    if path.is_dir():
        if set_of_folder(path) is not None or is_file_like(path / "data_batch_1"):
            return read_batch_dir(path)
        for spec in OFFICIAL_SETS.values():
            if (path / spec.folder).is_dir():
                return read_batch_dir(path / spec.folder)
            archive = path / spec.archive
            if archive.exists() and not archive.is_dir():  # a FIFO there is refused by name, not ignored
                return read_archive(archive)
        root = find_split_root(path)
        if root is not None:
            return _cached(root, cache, read_folder, decode, log, write)
        if download_missing:
            return _download(path, log, download_set, write)
        if not any(path.iterdir()):
            raise DataError(f"{path}: empty folder; {hint}")
        raise DataError(
            f"{path}: unknown layout (no cifar-10-batches-py/, cifar-100-python/, their .tar.gz, "
            f"or train/ and test/ class folders); {hint}"
        )
    if os.path.lexists(path):  # a FIFO, a device, a symlink loop, or behind a folder it may not enter
        try:
            reason = f"{kind(path.stat().st_mode)}, not a data file or folder"
        except OSError as exc:
            reason = why(exc)
        raise DataError(f"{path}: {reason}")
    if download_missing:
        return _download(path, log, download_set, write)
    raise DataError(f"{path}: no such file or folder; {hint}")


def shard_indices(n: int, rank: int, world_size: int, seed: int = 0) -> np.ndarray:
    """The fixed training-set shard of ``rank``: every index in exactly one shard, the same
    shard at every epoch. A fixed permutation first, so an image folder (stored class by
    class) still gives every rank every class; then every ``world_size``-th index."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[rank::world_size])


def rank_shard(index: np.ndarray, n_read: int, rank: int, world_size: int) -> np.ndarray:
    """The positions in ``index`` (data-set indices: ``Dataset.index``) that fall in ``rank``'s
    shard of the whole training set as read (``shard_indices(n_read, ...)``): an image's rank does
    not depend on the subset, so a subset without an image takes it out of one rank's shard and
    leaves every other rank's as it was. A subset can leave the shards a few images apart in size
    (``shard_sizes``: the steps follow the smallest)."""
    owner = np.empty(n_read, dtype=np.int64)
    owner[np.random.default_rng(0).permutation(n_read)] = np.arange(n_read) % world_size  # shard_indices' deal
    return np.flatnonzero(owner[index] == rank)


def shard_sizes(index: np.ndarray, n_read: int, world_size: int) -> list[int]:
    """Each rank's number of images (``rank_shard``)."""
    return [len(rank_shard(index, n_read, r, world_size)) for r in range(world_size)]
