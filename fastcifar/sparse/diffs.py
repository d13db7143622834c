"""Small checkpoints: a base model file, then one sparse diff per epoch against the state before it.

A diff is a safetensors file holding, for every parameter with entries that changed since the
previous state, ``param/<name>/idx`` (int32 positions in the parameter's row-major flattening) and
``param/<name>/val`` (the new values, so a restore writes them, bit-exact, instead of adding);
and every buffer dense as ``buffer/<name>`` (batchnorm running statistics and counters change
everywhere every step). Its metadata names the format, the epoch, the parent file and the
parent's SHA-256, so a chain restored in the wrong order or with a file missing is refused.
"Changed" is an exact comparison with the previous state: under a fixed mask it is a subset of the
mask (the tests hold the trainer to that), and anything else that moved is recorded too, so a
restore is exact whatever trained. Files are written to a temporary name and renamed.

    python -m fastcifar.checkpoint inspect RUN_DIR/sparse/run1/*.safetensors
    python -m fastcifar.checkpoint restore BASE DIFF [DIFF ...] --out model.safetensors [--data PATH]

(``python -m fastcifar.sparse.diffs`` is the same command.)

``restore`` writes the model file of the last diff's epoch; with ``--data`` it also evaluates it on
the test set as the trainer does (its TTA, on the CPU) and prints the accuracy.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..data import DataError

BASE_FORMAT = "fastcifar.model/1"
DIFF_FORMAT = "fastcifar.sparse_diff/1"


def sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _save_atomic(tensors: dict, metadata: dict, path: Path) -> int:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return path.stat().st_size


def host_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as contiguous CPU copies (row-major: the diffs' index order)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}


def write_base(path: str | Path, state: dict[str, torch.Tensor], cfg, classes, mean, std,
               test_acc: float | None = None) -> int:
    """A model file (fastcifar.checkpoint's format) of a host state dict; returns its size in bytes."""
    from ..checkpoint import save_weights  # late: fastcifar.checkpoint may be running as __main__
    return save_weights(path, state, cfg, classes, test_acc, mean, std).stat().st_size


def make_diff(prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor],
              param_names: set[str]) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, t in cur.items():
        if name not in param_names:
            tensors[f"buffer/{name}"] = t
            continue
        flat, old = t.view(-1), prev[name].view(-1)
        changed = (flat != old).nonzero().squeeze(1)
        if changed.numel():
            tensors[f"param/{name}/idx"] = changed.to(torch.int32)
            tensors[f"param/{name}/val"] = flat[changed].clone()
    return tensors


def apply_diff(state: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    for key, t in tensors.items():
        if key.startswith("buffer/"):
            state[key[len("buffer/"):]] = t.clone()
        elif key.endswith("/idx"):
            name = key[len("param/"):-len("/idx")]
            flat = state[name].view(-1)
            flat[t.long()] = tensors[f"param/{name}/val"].to(flat.dtype)


class DiffWriter:
    """Rank 0's chain for one run: ``start`` keeps the initial state (in memory; the base file is
    written with the first diff, off the clock), ``epoch`` writes that epoch's diff and returns a
    log line with its size next to the dense model file's."""

    def __init__(self, folder: Path, model: torch.nn.Module, cfg, classes, mean, std):
        self.folder, self.model, self.cfg = Path(folder), model, cfg
        self.classes, self.mean, self.std = classes, mean, std
        self.param_names = {n for n, _ in model.named_parameters()}
        self.prev: dict[str, torch.Tensor] | None = None
        self.parent: Path | None = None
        self.dense_bytes = 0
        self.records: list[dict] = []

    def start(self) -> None:
        self.prev = {k: v.detach().clone() for k, v in self.model.state_dict().items()}  # on the device

    def epoch(self, epoch: int, test_acc: float) -> str:
        if self.parent is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.prev = {k: v.to("cpu").contiguous() for k, v in self.prev.items()}
            self.parent = self.folder / "base.safetensors"
            self.dense_bytes = write_base(self.parent, self.prev, self.cfg, self.classes, self.mean, self.std)
        cur = host_state(self.model)
        tensors = make_diff(self.prev, cur, self.param_names)
        path = self.folder / f"epoch{epoch:03d}.safetensors"
        meta = {"format": DIFF_FORMAT, "epoch": str(epoch), "parent": self.parent.name,
                "parent_sha256": sha256(self.parent), "test_acc": str(test_acc)}
        size = _save_atomic(tensors, meta, path)
        entries = sum(t.numel() for k, t in tensors.items() if k.endswith("/idx"))
        self.records.append({"epoch": epoch, "file": path.name, "bytes": size, "dense_bytes": self.dense_bytes,
                             "changed_entries": entries})
        self.prev, self.parent = cur, path
        return (f"sparse diff epoch {epoch}: {size:,} bytes ({entries:,} changed entries + dense BN buffers), "
                f"dense model file {self.dense_bytes:,} bytes ({100.0 * size / self.dense_bytes:.2f}%)")


def read(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return load_file(str(path)), meta


class ChainError(Exception):
    pass


def restore(base: str | Path, diffs: list[str | Path]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state dict after the last of ``diffs`` (in order), and the base file's metadata."""
    state, meta = read(base)
    if meta.get("format") != BASE_FORMAT:
        raise ChainError(f"{base}: not a model file (format {meta.get('format')!r}, expected {BASE_FORMAT})")
    parent = Path(base)
    for d in diffs:
        tensors, dmeta = read(d)
        if dmeta.get("format") != DIFF_FORMAT:
            raise ChainError(f"{d}: not a sparse diff (format {dmeta.get('format')!r})")
        if dmeta.get("parent_sha256") != sha256(parent):
            raise ChainError(f"{d}: its parent is {dmeta.get('parent')!r} (epoch chain broken or out of "
                             f"order): it does not follow {parent.name}")
        apply_diff(state, tensors)
        parent = Path(d)
    return state, meta


def config_of(meta: dict[str, str]):
    from ..config import Config
    raw = json.loads(meta["config"])
    names = {f.name for f in dataclasses.fields(Config)}
    raw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in names}
    return Config(**raw)


def evaluate_state(state: dict[str, torch.Tensor], meta: dict[str, str], data: str) -> float:
    """Test accuracy (%) of a restored state, evaluated as the trainer evaluates (fp32, CPU)."""
    from .. import distributed
    from ..data import load_dataset
    from ..graphs import EvalStep, StaticBatch
    from ..loader import EvalSet
    from ..train import build_model, evaluate
    cfg = dataclasses.replace(config_of(meta), kernels="torch", data=data)
    device = torch.device("cpu")
    model = build_model(cfg, device, torch.float32)
    model.load_state_dict(state)
    ds = load_dataset(data, False, cfg.cache_dir or None).subset(cfg.subset)
    test_set = EvalSet(ds.test_images, ds.test_labels, cfg.eval_batch_size, dtype=torch.float32, device=device)
    step = EvalStep(model, StaticBatch(cfg.eval_batch_size, torch.float32, device), cfg.tta, capture=False)
    ctx = distributed.DistContext(0, 1, 0, device, None)
    return evaluate(model, step, test_set, ctx)[1]


def inspect_lines(path: str | Path) -> list[str]:
    tensors, meta = read(path)
    size = Path(path).stat().st_size
    if meta.get("format") == BASE_FORMAT:
        n = sum(t.numel() for t in tensors.values())
        return [f"{path}: model file, {len(tensors)} tensors, {n:,} values, {size:,} bytes"]
    lines = [f"{path}: sparse diff, epoch {meta.get('epoch')}, parent {meta.get('parent')}, "
             f"test_acc {meta.get('test_acc')}, {size:,} bytes"]
    for key, t in tensors.items():
        if key.endswith("/idx"):
            lines.append(f"  {key[len('param/'):-len('/idx')]}: {t.numel():,} entries")
        elif key.startswith("buffer/"):
            lines.append(f"  {key[len('buffer/'):]}: dense {tuple(t.shape)}")
    return lines


def main(argv: list[str] | None = None, prog: str = "python -m fastcifar.sparse.diffs") -> int:
    parser = argparse.ArgumentParser(prog=prog,
                                     description="Inspect sparse diffs, or restore a model from a base file "
                                                 "and a chain of them.")
    sub = parser.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="what each file holds")
    ins.add_argument("files", nargs="+")
    res = sub.add_parser("restore", help="base file + diffs in epoch order -> one model file")
    res.add_argument("base")
    res.add_argument("diffs", nargs="*")
    res.add_argument("--out", default="", help="model file to write (the base's format); empty: none")
    res.add_argument("--data", default="", help="evaluate the restored model on this data's test set")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            for f in args.files:
                print("\n".join(inspect_lines(f)))
            return 0
        state, meta = restore(args.base, args.diffs)
        if args.out:
            if Path(args.out).exists():
                raise ChainError(f"{args.out} exists; not overwriting it")
            last = read(args.diffs[-1])[1].get("test_acc") if args.diffs else meta.get("test_acc")
            write_base(args.out, state, config_of(meta), json.loads(meta["classes"]), json.loads(meta["mean"]),
                       json.loads(meta["std"]), float(last) if last else None)
            print(f"wrote {args.out}")
        if args.data:
            print(f"test_acc {evaluate_state(state, meta, args.data):.4f}")
        return 0
    except (ChainError, DataError, SafetensorError, OSError, KeyError, ValueError) as exc:
        print(f"fastcifar: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
