"""Write any data set fastcifar reads as ``train.pt`` and ``test.pt`` in the form the GPU-resident
CIFAR loaders of the public speedrun scripts (airbench, hiverge) read: a dict of ``images`` (uint8,
N x 32 x 32 x 3), ``labels`` (int64, N) and ``classes`` (a list of names).

    python scripts/export_tensors.py --data PATH --out DIR

Why: the race (scripts/gpu_visit.sh race, scripts/race.py) times fastcifar against the public
scripts on the same machine and the same images; they decode nothing themselves and read these two
files from their ``cifar10/`` folder, so pointing them at our images means writing them there. Each
file is written atomically (``core.atomic.write_atomic``): an interrupted export leaves no file a later
run would trust. Bad input is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout, uninstalled

from fastcifar.core.atomic import write_atomic
from fastcifar.data import DataError, load_dataset


def export(data: str | Path, out: str | Path, log=print) -> list[Path]:
    """Decode ``data`` (any layout ``load_dataset`` reads) into ``out``/{train,test}.pt."""
    ds = load_dataset(data, log=log)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for split in ("train", "test"):
        doc = {
            "images": torch.from_numpy(getattr(ds, f"{split}_images")).contiguous(),
            "labels": torch.from_numpy(getattr(ds, f"{split}_labels")).long(),
            "classes": list(ds.classes),
        }
        target = out / f"{split}.pt"
        buffer = io.BytesIO()
        torch.save(doc, buffer)
        write_atomic(target, buffer.getvalue())
        written.append(target)
        log(f"{target}: {len(doc['labels'])} images")
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--data", required=True, help="a data set fastcifar reads (archive, folder, official files)")
    p.add_argument("--out", required=True, help="the folder that receives train.pt and test.pt")
    args = p.parse_args(argv)
    try:
        export(args.data, args.out)
    except (DataError, OSError) as exc:
        print(f"export_tensors: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
