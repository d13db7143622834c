"""Files written whole or not at all: summaries, model files, training checkpoints, sparse records.

``write_atomic`` writes ``.<name>.<pid>-<token>.tmp`` beside the target, fsyncs it, renames it over
the target and fsyncs the folder, so after a crash, a power cut or a full disk the target is either
the previous file or the new one, whole. The temporary's name is chosen before the file exists, so
a signal at any point (SIGINT and SIGTERM raise in the main thread, ``core.signals``) leaves no
temporary behind: the ``finally`` that removes it always knows its name. Only SIGKILL (or a power
cut) can leave one; ``remove_stale`` clears those: ``write_atomic`` for its own target, and a
resume (``run.state``) for the whole folder of the checkpoint it reads.
"""

from __future__ import annotations

import errno
import fnmatch
import glob
import os
import re
import secrets
import socket
import time
from pathlib import Path

# .<target>.<writer's host>.<writer's pid>-<8 hex>.tmp. Older names (tempfile.mkstemp's 8 characters
# of [a-z0-9_], or a pid without a host) and another host's are judged by age alone: a pid says
# nothing about a process on another node sharing the folder.
_TMP = re.compile(
    r"^\.(?P<target>.+?)\.(?:(?P<host>[A-Za-z0-9_-]+)\.(?P<pid>\d+)-[0-9a-f]{8}|\d+-[0-9a-f]{8}"
    r"|[a-z0-9_]{8})\.tmp$"
)
STALE_AGE_S = 600.0  # a temporary whose writer cannot be told (another host, old name) is stale after this


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"


def output_problem(out: str | Path, inputs, option: str) -> str | None:
    """Why a command's output file ``out`` (named by ``option``) cannot be written, in one line, or
    None: it is one of the command's ``inputs`` (the same path, a hard link or a symlink to one:
    the same device and inode), which an output must never replace, --force or not; or its folder
    does not exist. A command never makes that folder: a typo in the path would quietly make
    folders, so every command that writes a file asks for one that exists."""
    out = Path(out)
    for source in inputs:
        try:
            same = os.path.samefile(out, source)
        except (OSError, ValueError):  # either is missing or unreadable: not the same file
            same = False
        if same:
            return f"{option} {out} is the input {source}; write the output to another file"
    if not out.parent.is_dir():
        return f"{out.parent}: no such folder (make it first)"
    return None


def temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{_host()}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def fsync_dir(folder: str | Path) -> None:
    """Make a rename or unlink in ``folder`` durable; a no-op where the file system cannot fsync
    a folder."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # best effort: the rename has happened, and some file systems cannot (EINVAL, ...)
        pass
    finally:
        os.close(fd)


def _write_file(tmp: str | Path, blob: bytes) -> None:
    with open(tmp, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename makes it the target


def write_atomic(path: str | Path, data: str | bytes, replace: bool = True) -> Path:
    """``data`` into a temporary file beside ``path``, fsynced, then renamed to it and the folder
    fsynced: a crash, a signal or a full disk mid-write leaves the previous file whole (and no
    temporary behind, SIGKILL aside). ``replace=False``: FileExistsError when ``path`` exists, also
    when another process made it a moment ago (two ``export``s to one new path: one wins, the other
    is told), decided by the kernel's link (``_publish``), not by an earlier look."""
    path = Path(path)
    blob = data.encode("utf-8") if isinstance(data, str) else data
    remove_stale(path.parent, glob.escape(path.name))  # what a killed writer of this file left
    tmp = temporary_name(path)  # named before it exists: the finally below can always remove it
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644))
        _write_file(tmp, blob)
        os.chmod(tmp, 0o644)  # whatever the umask: as readable as the run's other files
        if replace:
            os.replace(tmp, path)
        else:
            _publish(tmp, path)
    finally:
        try:
            os.unlink(tmp)  # still there: the write failed or was interrupted
        except FileNotFoundError:
            pass
    fsync_dir(path.parent)
    return path


def _publish(tmp: Path, path: Path) -> None:
    """``tmp`` as ``path`` unless ``path`` exists (FileExistsError): a hard link is created only
    where no name is, atomically. A file system without hard links (FAT, some network mounts) gets
    a look and a rename, which two writers in the same instant could both pass."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, "File exists", str(path)) from None  # named: the target, not tmp
    except OSError:
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, "File exists", str(path)) from None
        os.replace(tmp, path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale(folder: str | Path, targets: str | tuple[str, ...], max_age_s: float = STALE_AGE_S) -> list[Path]:
    """Remove the temporaries ``write_atomic`` left in ``folder`` when its writer was killed
    (SIGKILL, power cut), for the target names matching ``targets`` (fnmatch patterns, e.g.
    "model*.safetensors"): a folder may hold other programs' files. A temporary is stale
    when the process that named it is gone, or (an old name without a pid) it is older than
    ``max_age_s``; one that a live writer is filling is left alone. Best effort: returns what it
    removed, never raises."""
    removed = []
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        m = _TMP.match(name)
        if m is None or not any(fnmatch.fnmatchcase(m["target"], t) for t in targets):
            continue
        p = Path(folder) / name
        try:
            if m["pid"] is not None and m["host"] == _host():
                stale = int(m["pid"]) != os.getpid() and not _alive(int(m["pid"]))
            else:
                stale = now - p.lstat().st_mtime > max_age_s
            if stale:
                p.unlink()
                removed.append(p)
        except OSError:
            continue
    return removed
