"""Image-folder CIFAR: ``train/<class>/*`` and ``test/<class>/*``, as a folder or a ``.tar.gz`` of one.

Decoding 60,000 small JPEGs takes seconds, so the decoded arrays are cached once as an ``.npz``
keyed by the source's path, size and modification time; the second start reads the cache instead.
The cache is written to a temporary file and renamed into place, so an interrupted start never
leaves a half-written cache that a later start would trust.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import tarfile
import tempfile
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import numpy as np
from PIL import Image, UnidentifiedImageError

from fastcifar.core import environment
from fastcifar.core.errors import DataError
from fastcifar.core.names import check_class_names, printable
from fastcifar.core.readfile import read_regular, why
from fastcifar.data.dataset import IMAGE_SHAPE, Dataset

SPLITS = ("train", "test")
# what PIL reads without plug-ins; a GIF or a multi-page TIFF gives its first frame
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".tif", ".tiff", ".gif"}
CACHE_VERSION = 2  # bump when the decoded form changes, so stale caches are not read (2: the skipped-files note)


def find_split_root(path: Path) -> Path | None:
    """The folder holding ``train/`` and ``test/``: ``path`` itself or its single subfolder."""
    if (path / "train").is_dir() and (path / "test").is_dir():
        return path
    subdirs = [Path(e.path) for e in _scan(path) if _is_dir(e) and not e.name.startswith(".")]
    if len(subdirs) == 1:
        return find_split_root(subdirs[0]) if subdirs[0] != path else None
    return None


SKIPPED_NAMED = 3  # skipped files named in the note; the rest are counted


def skipped_note(skipped: list[PurePosixPath], source: str) -> str:
    """One line counting and naming (the first SKIPPED_NAMED) the image files under train/ or test/
    that are not directly in a class folder, so not read; "" when there are none."""
    if not skipped:
        return ""
    names = ", ".join(printable(str(p)) for p in sorted(skipped)[:SKIPPED_NAMED])
    more = f", ... (first {SKIPPED_NAMED})" if len(skipped) > SKIPPED_NAMED else ""
    return (
        f"note: {printable(source)}: skipped {len(skipped)} image file{'s' if len(skipped) > 1 else ''} "
        f"not directly in train/<class>/ or test/<class>/: {names}{more}"
    )


def _split_files(entries: list[tuple[PurePosixPath, object]], source: str):
    """Group (relative path, handle) pairs into {split: {class: [handle, ...]}} and check classes;
    also the note on the image files left out (``skipped_note``)."""
    tree: dict[str, dict[str, list]] = {s: {} for s in SPLITS}
    skipped = []
    for rel, handle in entries:
        if rel.suffix.lower() not in IMAGE_SUFFIXES or not rel.parts or rel.parts[0] not in SPLITS:
            continue  # not an image (a README, .DS_Store) or not under train/ or test/: not data
        if len(rel.parts) != 3:  # in a class's subfolder, or in train/ itself: an image that was meant to count
            skipped.append(rel)
            continue
        split, cls, _ = rel.parts
        tree[split].setdefault(cls, []).append((rel, handle))
    train_classes, test_classes = sorted(tree["train"]), sorted(tree["test"])
    if not train_classes:
        raise DataError(f"{source}: no images under train/<class>/")
    if len(train_classes) == 1:  # every label the same: 100% accuracy that says nothing
        raise DataError(
            f"{source}: one class folder under train/ ({printable(train_classes[0])}); a classifier needs two or more"
        )
    if train_classes != test_classes:
        only_train = sorted(set(train_classes) - set(test_classes))
        only_test = sorted(set(test_classes) - set(train_classes))
        raise DataError(
            f"{source}: class folders of train/ and test/ differ "
            f"(only in train: {only_train or 'none'}; only in test: {only_test or 'none'})"
        )
    # before any image is decoded: the folder names become the model file's class names
    check_class_names(train_classes, f"{source}: class folders under train/", DataError)
    return tree, tuple(train_classes), skipped_note(skipped, source)


MAX_HEADER_PIXELS = 1 << 26  # 8192x8192: predict resizes up to this; larger is refused before decoding


def open_image(fp, where: str) -> Image.Image:
    """``Image.open`` (which reads the header only) with PIL's decompression-bomb guard as a
    DataError: a 20000x20000 PNG is refused by its header, before any pixel is decoded."""
    try:
        img = Image.open(fp)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise DataError(f"{where}: image too large to decode ({exc})") from None
    w, h = img.size
    if w * h > MAX_HEADER_PIXELS:
        img.close()
        raise DataError(f"{where}: image is {w}x{h}, too large to decode (at most {MAX_HEADER_PIXELS} pixels)")
    return img


@contextlib.contextmanager
def bomb_warnings_as_errors():
    """PIL's DecompressionBombWarning (an image of 89M to 179M pixels) as an error, which
    ``open_image`` turns into one line instead of a warning on stderr. Entered once around a whole
    decode (``decode_with_pil``, in the calling thread)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        yield


def _decode(raw: bytes, where: str) -> np.ndarray:
    try:
        with open_image(io.BytesIO(raw), where) as img:
            if img.size != IMAGE_SHAPE[1::-1]:  # from the header: the pixels are never decoded
                raise DataError(f"{where}: image is {img.size[0]}x{img.size[1]}, expected 32x32")
            img = img.convert("RGB")
            array = np.asarray(img, dtype=np.uint8)
    except UnidentifiedImageError:
        raise DataError(f"{where}: not a readable image (no format PIL knows)") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise DataError(f"{where}: not a readable image ({exc})") from None
    if array.shape != IMAGE_SHAPE:
        raise DataError(f"{where}: image is {array.shape[1]}x{array.shape[0]}, expected 32x32")
    return array


def decode_with_pil(raws: list[bytes], wheres: list[str]) -> np.ndarray:
    """(N, 32, 32, 3) uint8 of ``raws`` in order; the first bad one is named (DataError).

    One thread: a 32x32 image's decode is mostly Python (open, header check, convert, asarray) that
    holds the GIL, so a pool only added its hand-offs: 20,000 images of the JPEG copy took 7.7 s in a
    pool of two threads with a future each, 4.1 s in one (2 cores, 2026-12-07). An error or a signal
    stops at that image."""
    with bomb_warnings_as_errors():
        return np.stack([_decode(raw, where) for raw, where in zip(raws, wheres, strict=True)])


# A batch decoder: (encoded images, their names) -> (N, 32, 32, 3) uint8, or None to leave the
# batch to PIL (which then names the file that is bad). fastcifar.data.dali.dali_decoder is one.
BatchDecoder = Callable[[list, list], np.ndarray | None]


def _decode_tree(tree, classes, read, source: str, decode: BatchDecoder | None = None, note: str = "") -> Dataset:
    arrays = {}
    for split in SPLITS:
        items = [
            (rel, handle, label)
            for label, cls in enumerate(classes)
            for rel, handle in sorted(tree[split][cls], key=lambda t: str(t[0]))
        ]
        wheres = [f"{source}/{rel}" for rel, _, _ in items]
        raws = [read(handle, where) for (_, handle, _), where in zip(items, wheres, strict=True)]
        images = decode(raws, wheres) if decode is not None else None
        if images is None:
            images = decode_with_pil(raws, wheres)
        arrays[split] = (images, np.array([lab for _, _, lab in items], dtype=np.int64))
    return Dataset(*arrays["train"], *arrays["test"], classes, source, note=note).validate()


def _scan(folder: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as it:
            return list(it)
    except OSError as exc:  # e.g. an unreadable class folder: named, not mistaken for a missing class
        raise DataError(f"{folder}: cannot read folder: {why(exc)}") from None


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:  # a symlink loop: not a folder; read as a file, it is refused by name
        return False


def _folder_entries(root: Path) -> list[tuple[PurePosixPath, Path]]:
    """Every ``<split>/<class>/<file>`` under ``root`` that is not a folder (a FIFO or a symlink
    loop among the images is kept, and refused by name when read), and every file deeper, in a
    class's subfolders or directly in ``<split>/`` (not read: ``_split_files`` counts them)."""
    entries = []
    for split in _scan(root):
        if split.name not in SPLITS or not _is_dir(split):
            continue
        for cls in _scan(Path(split.path)):
            if not _is_dir(cls):
                entries.append((PurePosixPath(split.name, cls.name), Path(cls.path)))
                continue
            for f in _scan(Path(cls.path)):
                rel = PurePosixPath(split.name, cls.name, f.name)
                if not _is_dir(f):
                    entries.append((rel, Path(f.path)))
                    continue
                for folder, _, files in os.walk(f.path):  # symlinked folders are not followed: no loops
                    inner = PurePosixPath(rel, Path(folder).relative_to(f.path).as_posix())
                    entries += [(PurePosixPath(inner, name), Path(folder, name)) for name in files]
    return entries


def read_folder(root: Path, decode: BatchDecoder | None = None) -> Dataset:
    tree, classes, note = _split_files(_folder_entries(root), str(root))

    def read(p: Path, where: str) -> bytes:
        try:
            return read_regular(p)  # a FIFO is refused, not waited on
        except OSError as exc:
            raise DataError(f"{where}: cannot read image: {why(exc)}") from None

    return _decode_tree(tree, classes, read, str(root), decode, note)


def tar_split_prefix(names: list[str]) -> str | None:
    """The member prefix under which ``train/`` and ``test/`` sit in an archive, or None."""
    for name in names:
        parts = PurePosixPath(name).parts
        for i in range(len(parts) - 1):
            if parts[i] == "train":
                prefix = "/".join(parts[:i])
                test_dir = f"{prefix}/test/" if prefix else "test/"
                if any(n.startswith(test_dir) for n in names):
                    return prefix
    return None


def read_folder_archive(
    path: Path, tar: tarfile.TarFile, members: list[tarfile.TarInfo], decode: BatchDecoder | None = None
) -> Dataset:
    names = [m.name.lstrip("./") for m in members]
    prefix = tar_split_prefix(names)
    if prefix is None:
        raise DataError(f"{path}: unknown layout (no train/ and test/ folders, no cifar-10-batches-py/)")
    strip = len(PurePosixPath(prefix).parts) if prefix else 0
    entries = [
        (PurePosixPath(*PurePosixPath(n).parts[strip:]), m)
        for n, m in zip(names, members, strict=True)
        if m.isfile() and len(PurePosixPath(n).parts) > strip
    ]
    tree, classes, note = _split_files(entries, str(path))

    def read(member: tarfile.TarInfo, where: str) -> bytes:
        try:
            return tar.extractfile(member).read()
        except Exception as exc:
            raise DataError(f"{where}: truncated or corrupt archive ({exc})") from None

    return _decode_tree(tree, classes, read, str(path), decode, note)


# ---------------------------------------------------------------------------------------------
# The cache of decoded arrays


def default_cache_dir() -> tuple[Path | None, str]:
    """The user cache folder for decoded arrays, ``$XDG_CACHE_HOME/fastcifar`` or
    ``$HOME/.cache/fastcifar``, and "" ; or None and a note saying why there is none. Only
    ``fastcifar`` (and ``.cache`` in an existing home) is ever created: a ``HOME`` that does not
    exist (a service account's ``/nonexistent``) once had four folders made from ``/`` down. A
    relative ``XDG_CACHE_HOME`` is ignored, as the XDG spec says."""
    xdg = environment.xdg_cache_home()
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        return Path(xdg) / "fastcifar", ""
    home = environment.home()
    if environment.home_is_a_folder():
        return Path(home) / ".cache" / "fastcifar", ""
    where = f"XDG_CACHE_HOME {xdg!r} and " if xdg else ""
    return None, (
        f"note: no decode cache: {where}HOME {home!r} is not an existing folder, and the data's folder is "
        f"not writable; the images are decoded again next time (--cache-dir FOLDER keeps them)"
    )


def decoder_name(decode: BatchDecoder | None) -> str:
    """What decodes a folder's images: a batch decoder's ``name`` attribute, else "pil"."""
    return getattr(decode, "name", "pil") if decode is not None else "pil"


def source_fingerprint(source: Path, decoder: str = "pil") -> str:
    """Path, size and modification time of the source, and of every file in it if a folder, and
    the decoder: any edit to the data gives a new cache key, so a stale cache is never read, and
    nvJPEG's pixels (up to 32 levels off PIL's on a GPU) never stand in for PIL's or the reverse."""
    st = source.stat()
    parts = [f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CACHE_VERSION}|{decoder}"]
    if source.is_dir():
        for p in sorted(source.rglob("*")):
            if p.is_file():
                s = p.stat()
                parts.append(f"{p.relative_to(source)}|{s.st_size}|{s.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def cache_path(source: Path, cache_dir: Path | None, decoder: str = "pil") -> tuple[Path | None, str]:
    """Where the decoded arrays of ``source`` (decoded by ``decoder``) are cached: ``cache_dir``,
    else next to the data if that folder is writable, else the user cache folder; with "" or, when
    there is no place for them (``default_cache_dir``), None and a note."""
    name = f"{source.name}.fastcifar-{source_fingerprint(source, decoder)}.npz"
    if cache_dir is not None:
        return cache_dir / name, ""
    if os.access(source.parent, os.W_OK):
        return source.parent / f".{name}", ""
    folder, note = default_cache_dir()
    return (folder / name if folder is not None else None), note


def load_cache(path: Path, source: str) -> Dataset | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            return Dataset(
                z["train_images"],
                z["train_labels"],
                z["test_images"],
                z["test_labels"],
                tuple(str(c) for c in z["classes"]),
                source,
                note=str(z["note"]) if "note" in z.files else "",
            ).validate()
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, DataError):
        return None  # an unreadable cache is rebuilt, never trusted


def save_cache(path: Path, ds: Dataset) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(
                f,
                train_images=ds.train_images,
                train_labels=ds.train_labels,
                test_images=ds.test_images,
                test_labels=ds.test_labels,
                classes=np.array(ds.classes),
                note=np.array(ds.note),
            )
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cache is as readable as the data
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
