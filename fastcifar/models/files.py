"""Model files: the trained network and what describes it, written and read in one place.

Model file (``model.safetensors``, format ``fastcifar.model/1``): the network's state_dict (every
parameter and buffer, contiguous, in its training dtype) in safetensors, which stores raw tensors
and runs no code when read. Its string metadata makes the file self-sufficient:

    format      "fastcifar.model/1"
    config      JSON of dataclasses.asdict(Config): architecture and widths come from here
    classes     JSON list of class names (their count sizes the last layer)
    mean, std   JSON lists: the per-channel normalization, in 0..255 pixel units
    test_acc    str(float): the run's final test accuracy in %, with the config's TTA; "" when the
                file was written before any evaluation (a sparse-diff base)
    torch       the torch version that wrote it
    sha256      the file's digest (``digest``): the SHA-256 of the header (as canonical JSON, this
                key left out) followed by the tensor bytes, so a changed byte anywhere, a weight or
                a class name, is refused on every load (one line, exit 2) though it still decodes

``save_model`` / ``load_model`` (and their halves ``save_weights``, ``read_model_file``,
``network_from_weights``) are the only writer and reader: the trainer, ``evaluate``, ``predict``,
the API and the sparse diffs' base and restored files all use them.


Written to a temporary file in the target's folder and renamed over it (``core.atomic``), so a
crash mid-write leaves the previous file whole, with its digest in the same write. A file without
a digest (written before digests, or with the key removed) is refused: nothing tells a changed
byte from the original; ``python -m fastcifar.checkpoint seal OLD --out NEW`` writes a copy with
one for a file the user vouches for. Sparse diffs carry the same digest. Training checkpoints:
``fastcifar.run.state``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from fastcifar.core import atomic, gpu
from fastcifar.core.config import Config, ConfigError, check_fields
from fastcifar.core.errors import DataError, first_line
from fastcifar.core.names import check_class_names
from fastcifar.core.readfile import open_regular, why

MODEL_FORMAT = "fastcifar.model/1"
MODEL_NAME = "model.safetensors"
DIGEST_KEY = "sha256"  # the metadata key of a safetensors file's digest (``digest``)


class CheckpointError(DataError):
    """A model or checkpoint file that cannot be used: one line, exit 2."""


def write_atomic(path: str | Path, blob: str | bytes, replace: bool = True) -> Path:
    """``atomic.write_atomic`` for a model, state or sparse-record file (bytes or text). The content
    is built in memory first, so a full disk surfaces here as an OSError: one line
    (CheckpointError), exit 2."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return atomic.write_atomic(path, blob, replace)
    except FileExistsError as exc:
        if not replace and exc.filename == str(path):  # write_atomic's own refusal, not mkdir's
            raise CheckpointError(f"{path} exists; not overwriting it") from None
        raise CheckpointError(f"cannot write {path}: {exc.strerror or type(exc).__name__}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot write {path}: {exc.strerror or type(exc).__name__}") from None


def config_from_dict(values: dict) -> Config:
    """A Config from ``asdict`` output: JSON lists back to tuples; unknown keys (a newer writer's)
    are dropped, missing ones take their defaults."""
    known = {f.name: f for f in fields(Config)}
    kwargs = {}
    for name, value in values.items():
        if name in known:
            if name == "tta" and isinstance(value, bool):  # a level since 598525c, a flag before
                value = int(value)
            kwargs[name] = tuple(value) if isinstance(getattr(Config, name, None), tuple) else value
    return Config(**kwargs)


# ---------------------------------------------------------------------------------------------
# The model file


@dataclass
class ModelInfo:
    config: Config
    classes: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    test_acc: float | None  # None: written before any evaluation


def save_model(path, model: torch.nn.Module, cfg: Config, classes, test_acc: float | None, mean, std) -> Path:
    """Write ``model``'s state_dict and its metadata to ``path`` (safetensors), atomically.
    ``test_acc`` None (not evaluated yet) is stored as ""."""
    return save_weights(path, host_state(model), cfg, classes, test_acc, mean, std)


def host_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as contiguous CPU copies (row-major: the order the sparse diffs index)."""
    return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in model.state_dict().items()}


def save_weights(
    path, tensors: dict, cfg: Config, classes, test_acc: float | None, mean, std, replace: bool = True
) -> Path:
    """``save_model`` for a state dict already on the host (contiguous CPU tensors): the sparse
    diffs' base and restored files (fastcifar.run.sparse.diffs) are model files written here too."""
    check_class_names(list(classes), f"{path}: not written: class names", CheckpointError)
    metadata = {
        "format": MODEL_FORMAT,
        "config": json.dumps(dataclasses.asdict(cfg)),
        "classes": json.dumps(list(classes)),
        "mean": json.dumps([float(m) for m in mean]),
        "std": json.dumps([float(s) for s in std]),
        "test_acc": "" if test_acc is None else str(float(test_acc)),
        "torch": str(torch.__version__),
    }
    return write_safetensors(path, tensors, metadata, replace)


# The digest's place in a file being written: 64 zeros, replaced by the digest of the bytes with
# them in it. Same length, so no offset or padding changes.
DIGEST_PLACEHOLDER = "0" * 64


def _digest_at(blob, value: str) -> int | None:
    """Where in ``blob``'s header the 64 hex digits of ``"sha256":"<value>"`` start; None unless it
    occurs there exactly once (a metadata value holding that text has its quotes escaped)."""
    if len(blob) < 8 or len(value) != 64 or not value.isascii():
        return None
    (n,) = struct.unpack("<Q", bytes(blob[:8]))
    needle = f'"{DIGEST_KEY}":"{value}"'.encode()
    header = bytes(blob[8 : 8 + n])
    at = header.find(needle)
    if at < 0 or header.find(needle, at + 1) >= 0:
        return None
    return 8 + at + len(needle) - 65


def file_digest(blob, recorded: str) -> str | None:
    """The digest of a file's bytes as written, its digest's 64 digits (``recorded``) read as
    zeros: any byte changed anywhere, the header's order and spacing included, changes it. None
    when the file holds no ``"sha256":"<recorded>"`` in its header."""
    at = _digest_at(blob, recorded)
    if at is None:
        return None
    view = memoryview(blob)
    h = hashlib.sha256(view[:at])
    h.update(DIGEST_PLACEHOLDER.encode())
    h.update(view[at + 64 :])
    return h.hexdigest()


def digest(blob: bytes, header: dict | None = None) -> str | None:
    """The digest that model files written before ``file_digest`` carry (still accepted): SHA-256
    over the header as canonical JSON (sorted keys, no spaces; the ``sha256`` metadata key left
    out) and then the tensor bytes, in file order. It covers the header's content, not its bytes:
    the same header written in another order keeps it, which ``file_digest`` does not. None when
    ``blob`` has no readable header. ``header``: the blob's header as a reader parsed it already
    (``_read_sized``), not parsed again."""
    header = _header(blob) if header is None else header
    if header is None:
        return None
    (n,) = struct.unpack("<Q", blob[:8])
    meta = header.get("__metadata__")
    if isinstance(meta, dict):  # a copy: the caller's header keeps its digest
        header = {**header, "__metadata__": {k: v for k, v in meta.items() if k != DIGEST_KEY}}
    h = hashlib.sha256(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
    h.update(memoryview(blob)[8 + n :])
    return h.hexdigest()


def _header(blob: bytes) -> dict | None:
    """The JSON header of a safetensors file's bytes; None when there is no readable one."""
    if len(blob) < 8:
        return None
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        return None
    try:
        header = json.loads(blob[8 : 8 + n])
    except ValueError:
        return None
    return header if isinstance(header, dict) else None


def write_safetensors(path, tensors: dict, metadata: dict[str, str], replace: bool = True) -> Path:
    """``tensors`` and ``metadata`` as a safetensors file at ``path``, atomically, with its digest
    in the metadata (the one write makes file and digest appear together)."""
    from safetensors.torch import save

    metadata = {k: v for k, v in metadata.items() if k != DIGEST_KEY}
    blob = bytearray(save(tensors, metadata={**metadata, DIGEST_KEY: DIGEST_PLACEHOLDER}))
    value = file_digest(blob, DIGEST_PLACEHOLDER)
    at = _digest_at(blob, DIGEST_PLACEHOLDER)
    blob[at : at + 64] = value.encode()
    return write_atomic(path, bytes(blob), replace)


def load_model(path, device: str | torch.device = "cpu") -> tuple[torch.nn.Module, ModelInfo]:
    """The network of a model file, in eval mode, fp32, on ``device``; CheckpointError (one line)
    for a missing, corrupt, truncated or foreign file."""
    tensors, meta = read_model_file(path)
    return network_from_weights(tensors, meta, str(path), device)


def read_safetensors(
    path, what: str = "model file", fmt: str | None = None, digest_required: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (on the CPU) and string metadata of a safetensors file (``what``, for the
    error), in one read: the bytes checked against the digest are the bytes decoded. A digest that
    does not match is refused (one line); so is a file whose metadata does not name the format
    ``fmt`` (when given), and with ``digest_required`` one without a digest (``require_digest``);
    without it, a missing digest is the caller's to judge."""
    tensors, meta, _ = _read(path, what, fmt, digest_required)
    return tensors, meta


def read_with_sha256(path, what: str, fmt: str) -> tuple[dict[str, torch.Tensor], dict[str, str], str]:
    """``read_safetensors`` of a file in a sparse-diff chain (format ``fmt``, digest required), and
    the SHA-256 of its bytes, by which the next diff names it as its parent: hashed from the bytes
    this read holds, not read from the disk again."""
    tensors, meta, blob = _read(path, what, fmt, digest_required=True)
    return tensors, meta, hashlib.sha256(blob).hexdigest()


def _read(path, what: str, fmt: str | None, digest_required: bool) -> tuple[dict, dict[str, str], bytes]:
    """``read_safetensors``, with the bytes it read."""
    from safetensors.torch import load

    path = Path(path)
    try:
        # the OS's reason (permission, a FIFO, a loop), before safetensors reads it; the header parsed once
        blob, header = _read_sized(path, what)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such {what}") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read {what}: {why(exc)}") from None
    try:
        tensors = load(blob)
        if header is None:  # _read_sized found none where safetensors did: not a file to trust
            raise ValueError("no readable header")
        meta = header.get("__metadata__") or {}
    except Exception as exc:  # safetensors reports a damaged header or short file in several types
        if blob[:4] == b"PK\x03\x04":  # a torch.save zip
            raise CheckpointError(
                f"{path}: a training checkpoint (for --resume), not a {what}; the run's "
                f"model is {path.with_name(MODEL_NAME)}"
            ) from None
        raise CheckpointError(
            f"{path}: not a readable {what} ({type(exc).__name__}: {first_line(str(exc))[:200]})"
        ) from None
    recorded = meta.get(DIGEST_KEY)
    # the digest of the bytes as written; a file written before it, the digest of its content
    matches = recorded is None or file_digest(blob, recorded) == recorded or digest(blob, header) == recorded
    if not matches:
        raise CheckpointError(
            f"{path}: its contents do not match the digest written with them (sha256): the file "
            f"changed after it was written (a damaged disk or copy, or an edit); refusing to use it"
        )
    if fmt is not None and "format" not in meta:
        raise CheckpointError(plain_file_problem(path, what, fmt))
    if fmt is not None and meta.get("format") != fmt:
        raise CheckpointError(f"{path}: not a fastcifar {what} (format {meta.get('format')!r}, expected {fmt!r})")
    if digest_required:
        require_digest(path, meta, what)
    return tensors, meta, blob


def plain_file_problem(path, what: str, fmt: str) -> str:
    """The line for a safetensors file without fastcifar's metadata (``safetensors.torch.save_file``
    of a state dict writes none): what it lacks and how to make a model file of it."""
    if fmt != MODEL_FORMAT:
        return f"{path}: a plain safetensors file, not a fastcifar {what}: its metadata has no format ({fmt!r})"
    return (
        f"{path}: a plain safetensors file, not a fastcifar model file: its metadata lacks the keys a model "
        f"file needs (format {MODEL_FORMAT!r}, config, classes, mean, std); write the state dict with "
        f"fastcifar.models.files.save_weights (docs/models.md), which records them and the digest "
        f"(checkpoint seal adds only the digest)"
    )


MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on a header


def _read_sized(path: Path, what: str) -> tuple[bytes, dict | None]:
    """The file's bytes and its parsed header, read only when its size is the one the header
    gives (8 + header + the last tensor's end): a 1 TB sparse file of zeros, or a model file with
    gigabytes appended, is refused after reading its first bytes, not by filling the memory. The
    header is None (and the bytes only its start) when it is not one: safetensors says what is wrong."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if head[:4] == b"PK\x03\x04" or not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
            return head + f.read(min(size, 1 << 16)), None  # too short to be one
        text = f.read(n)
        try:
            header = json.loads(text)
            ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
            expected = 8 + n + max(ends, default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
            return head + text, None  # not a header
        if expected != size:
            raise CheckpointError(
                f"{path}: not a readable {what} (its header describes {expected:,} bytes, the file has "
                f"{size:,}: truncated, or something appended)"
            )
        return head + text + f.read(), header


def require_digest(path, meta: dict, what: str = "model file") -> None:
    """Refuse a file with no digest: nothing would tell a changed byte from the original."""
    if DIGEST_KEY not in meta:
        raise CheckpointError(
            f"{path}: this {what} carries no digest (written before fastcifar recorded one, or "
            f"edited), so a changed byte could not be told; if you trust it, "
            f"python -m fastcifar.checkpoint seal {path} --out NEW.safetensors writes a copy with one"
        )


def read_model_file(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    return read_safetensors(path, "model file", MODEL_FORMAT, digest_required=True)


MAX_CLASSES = 10000  # classes a model file may name: their count sizes the last layer


def model_info(meta: dict[str, str], source: str) -> ModelInfo:
    """A model file's metadata, parsed and checked before anything is built from it: the config's
    fields against their types and ranges (``check_fields``: a width of 30000 is refused before a
    32 GB allocation), the class names, 3 finite means and 3 finite positive stds, the accuracy;
    CheckpointError (one line) if any of it is missing or malformed."""
    try:
        values = json.loads(meta["config"])
        if not isinstance(values, dict):
            raise ValueError(f"config is a {type(values).__name__}, not a JSON object")
        info = ModelInfo(
            config_from_dict(values),
            tuple(json.loads(meta["classes"])),
            tuple(json.loads(meta["mean"])),
            tuple(json.loads(meta["std"])),
            float(meta["test_acc"]) if meta.get("test_acc") else None,
        )
    except Exception as exc:
        raise CheckpointError(f"{source}: unusable metadata ({type(exc).__name__}: {exc})") from None
    try:
        check_fields(info.config)
    except ConfigError as exc:
        raise CheckpointError(f"{source}: unusable metadata: config {exc}") from None
    if not 1 <= len(info.classes) <= MAX_CLASSES or not all(isinstance(c, str) for c in info.classes):
        raise CheckpointError(
            f"{source}: unusable metadata: classes must be 1..{MAX_CLASSES} names, "
            f"not {len(info.classes)} of types {sorted({type(c).__name__ for c in info.classes})}"
        )
    check_class_names(info.classes, f"{source}: unusable metadata: classes", CheckpointError)
    for name in ("mean", "std"):
        values = getattr(info, name)
        numbers_ok = len(values) == 3 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values
        )
        if not numbers_ok or (name == "std" and min(values) <= 0):
            raise CheckpointError(
                f"{source}: unusable metadata: {name} must be 3 finite numbers (one per channel)"
                f"{', each positive' if name == 'std' else ''}, not {list(values)}"
            )
    if info.test_acc is not None and not 0 <= info.test_acc <= 100:  # nan fails both
        raise CheckpointError(f"{source}: unusable metadata: test_acc must lie in 0..100, not {info.test_acc}")
    return info


def network_from_weights(
    tensors: dict[str, torch.Tensor], meta: dict[str, str], source: str, device: str | torch.device = "cpu"
) -> tuple[torch.nn.Module, ModelInfo]:
    """The network a model file's tensors and metadata describe (``load_model`` without the
    read: a sparse-diff chain restores its tensors in memory)."""
    from fastcifar.models.blocks import norm_blocks
    from fastcifar.models.network import make_network

    device = torch.device(device)
    if device.type == "cuda":  # evaluate, predict, the API: the trainer's preflight before any CUDA work (core.gpu)
        gpu.cuda_or_cpu("cuda")
        note = gpu.before_cuda_work(device.index if device.index is not None else torch.cuda.current_device())
        if note:
            print(f"fastcifar: {note}", file=sys.stderr, flush=True)
    info = model_info(meta, source)
    try:
        model = make_network(info.config, norm_blocks("auto", device), len(info.classes))
    except Exception as exc:
        raise CheckpointError(f"{source}: unusable metadata ({type(exc).__name__}: {exc})") from None
    _check_shapes(model.state_dict(), tensors, source)
    _check_finite(tensors, source)
    model.load_state_dict(tensors)
    return model.to(device=device, memory_format=torch.channels_last).eval(), info


def _check_shapes(want: dict, got: dict, source: str) -> None:
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        raise CheckpointError(
            f"{source}: tensors do not match the model (missing: {missing[:3] or 'none'}; "
            f"unexpected: {extra[:3] or 'none'})"
        )
    for name, t in want.items():
        if tuple(got[name].shape) != tuple(t.shape):
            raise CheckpointError(
                f"{source}: {name} has shape {tuple(got[name].shape)}, the model's is {tuple(t.shape)}"
            )


def _check_finite(tensors: dict, source: str) -> None:
    """NaN or infinite weights would evaluate to "loss nan" and exit 0: refuse them by name."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{source}: {name} holds NaN or infinite values")


def model_path(run_dir, run: int, runs: int) -> Path:
    """``model.safetensors`` for a single run, ``model-run<N>.safetensors`` for several."""
    return Path(run_dir) / (MODEL_NAME if runs == 1 else f"model-run{run}.safetensors")
