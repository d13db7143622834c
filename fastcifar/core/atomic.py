"""Files written whole or not at all: summaries, model files, training checkpoints, sparse records."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _write_file(tmp: str, data: str | bytes) -> None:
    with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """``data`` into a temporary file beside ``path``, then renamed to it: a crash or a full disk
    mid-write leaves the previous file whole (and no temporary behind)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        _write_file(tmp, data)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
