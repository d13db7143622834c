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

The command that inspects them and restores a model from a chain is ``fastcifar.checkpoint``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from fastcifar.core.readfile import hash_file
from fastcifar.models.files import (
    DIGEST_KEY,
    MODEL_FORMAT,
    CheckpointError,
    host_state,
    read_with_sha256,
    save_weights,
    write_safetensors,
)

DIFF_FORMAT = "fastcifar.sparse_diff/1"


def sha256(path: str | Path) -> str:
    return hash_file(path, hashlib.sha256())


def make_diff(
    prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor], param_names: set[str]
) -> dict[str, torch.Tensor]:
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
            state[key[len("buffer/") :]] = t.clone()
        elif key.endswith("/idx"):
            name = key[len("param/") : -len("/idx")]
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
            self.dense_bytes = (
                save_weights(self.parent, self.prev, self.cfg, self.classes, None, self.mean, self.std).stat().st_size
            )
        cur = host_state(self.model)
        tensors = make_diff(self.prev, cur, self.param_names)
        path = self.folder / f"epoch{epoch:03d}.safetensors"
        meta = {
            "format": DIFF_FORMAT,
            "epoch": str(epoch),
            "parent": self.parent.name,
            "parent_sha256": sha256(self.parent),
            "test_acc": str(test_acc),
        }
        size = write_safetensors(path, tensors, meta).stat().st_size  # with its digest, as model files
        entries = sum(t.numel() for k, t in tensors.items() if k.endswith("/idx"))
        self.records.append(
            {
                "epoch": epoch,
                "file": path.name,
                "bytes": size,
                "dense_bytes": self.dense_bytes,
                "changed_entries": entries,
            }
        )
        self.prev, self.parent = cur, path
        return (
            f"sparse diff epoch {epoch}: {size:,} bytes ({entries:,} changed entries + dense BN buffers), "
            f"dense model file {self.dense_bytes:,} bytes ({100.0 * size / self.dense_bytes:.2f}%)"
        )


class ChainError(CheckpointError):
    """A diff chain that does not restore: a diff that does not follow the file before it (out of
    order, or one missing between them). A file that cannot be read, or is not a diff, is a
    CheckpointError as for any safetensors file (``read_safetensors``)."""


def restore(base: str | Path, diffs: list[str | Path]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state dict after the last of ``diffs`` (in order), and the metadata of the model it is:
    the base file's, with the test_acc of the last diff's epoch (the base's "" without diffs) and
    without the base's digest (not these weights'). Each file is read once: the SHA-256 a diff
    names its parent by is taken from the bytes the parent's read holds."""
    state, meta, parent_sha256 = read_with_sha256(base, "model file", MODEL_FORMAT)
    parent = Path(base)
    for d in diffs:
        tensors, dmeta, sha256_of_d = read_with_sha256(d, "sparse diff", DIFF_FORMAT)
        if dmeta.get("parent_sha256") != parent_sha256:
            raise ChainError(
                f"{d}: its parent is {dmeta.get('parent')!r} (epoch chain broken or out of "
                f"order): it does not follow {parent.name}"
            )
        apply_diff(state, tensors)
        meta = {**meta, "test_acc": dmeta.get("test_acc", "")}
        parent, parent_sha256 = Path(d), sha256_of_d
    return state, {k: v for k, v in meta.items() if k != DIGEST_KEY}
