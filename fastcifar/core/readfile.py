"""Reading an input file the user named, with the OS's own reason when it cannot be read.

A path that is not a regular file (a FIFO, ``/dev/zero``, a folder, a socket) is refused before
any read: a FIFO would block forever waiting for a writer and ``/dev/zero`` would fill the memory.
It is opened non-blocking (a FIFO opens at once) and checked with ``fstat``, so what is checked is
what is read. Every failure is an ``OSError`` whose ``strerror`` says why ("Permission denied",
"Too many levels of symbolic links", "a FIFO (named pipe), not a regular file"); ``why`` gives it
for the one-line message.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotRegularFile(OSError):
    """The path exists but is not a regular file."""


def why(exc: OSError) -> str:
    """The OS's reason, as ``strerror`` has it ("Permission denied"), else the exception's text."""
    return exc.strerror or str(exc) or type(exc).__name__


def kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _open_regular(path: str | Path) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(errno.EINVAL, f"{kind(mode)}, not a regular file", str(path))
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_regular(path: str | Path):
    """The regular file ``path`` opened for reading (a binary file object); OSError
    (``NotRegularFile`` for a FIFO, a device, a folder) otherwise."""
    return os.fdopen(_open_regular(path), "rb")


def check_regular(path: str | Path) -> None:
    """Raise the OSError a read of ``path`` would meet (missing, unreadable, not a regular file)."""
    os.close(_open_regular(path))


class TooLarge(OSError):
    """The regular file is larger than its reader takes."""


def read_regular(path: str | Path, max_bytes: int | None = None) -> bytes:
    """The bytes of the regular file ``path``; OSError (``NotRegularFile`` for a FIFO, a device, a
    folder; ``TooLarge`` for more than ``max_bytes``, told by its size before it is read, and by
    reading no more than one byte past the bound: a file that grows meanwhile) otherwise."""
    with os.fdopen(_open_regular(path), "rb") as f:
        if max_bytes is None:
            return f.read()
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise TooLarge(errno.EFBIG, f"{size:,} bytes, more than the {max_bytes:,} it may have", str(path))
        blob = f.read(max_bytes + 1)
        if len(blob) > max_bytes:  # it grew since
            raise TooLarge(errno.EFBIG, f"more than the {max_bytes:,} bytes it may have", str(path))
        return blob


def hash_file(path: str | Path, h) -> str:
    """``h`` (a hashlib object) fed the bytes of the regular file ``path`` a block at a time, so a
    170 MB archive is never whole in memory; its hex digest. ``hashlib.file_digest`` does this
    from Python 3.11, and 3.10 is supported."""
    with open_regular(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
