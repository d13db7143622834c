"""The trainer with a local stand-in for ``--download`` (no network in CI), as torchrun launches it.

    FAKE_ARCHIVE=official.tar.gz FETCH_LOG=fetches.txt torchrun ... tests/helpers/fetch_worker.py ARGS

The stand-in copies FAKE_ARCHIVE into the --data folder as the official archive's name and appends
one line per fetch to FETCH_LOG: "rank R local L node N", so a test can count fetches per node.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import fastcifar.data
from fastcifar.data.official import CIFAR10


def fake_download(root: Path, progress=print, spec=CIFAR10) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, suffix=".part")  # renamed into place, as the real one does
    os.close(fd)
    shutil.copyfile(os.environ["FAKE_ARCHIVE"], tmp)
    os.replace(tmp, root / spec.archive)
    with open(os.environ["FETCH_LOG"], "a") as log:
        log.write(
            f"rank {os.environ.get('RANK')} local {os.environ.get('LOCAL_RANK')} node {os.environ.get('GROUP_RANK')}\n"
        )
    return root / spec.archive


if __name__ == "__main__":
    fastcifar.data.download = fake_download  # load_dataset's download, looked up when it is called
    from fastcifar.train import main

    sys.exit(main(sys.argv[1:]))
