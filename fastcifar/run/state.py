"""The training state a stopped run resumes from: one function saves it, one loads and checks it,
one puts it back into the run's objects.

Training state (``checkpoint.pt``, format ``fastcifar.state/1``), written at an epoch's end:
weights and batchnorm statistics, momentum buffers and per-group rate multipliers, the schedule's
step, the lookahead's slow copy, every RNG, the loader's (seed, epoch), and the epoch records so
far. Rank-local parts (RNGs, the lookahead copy, whose batchnorm entries follow each rank's own
batches) are gathered to rank 0, which writes one file; every rank reads it and takes its own
entry. A torch pickle read with ``weights_only=True``: tensors and plain containers only.

Written to a temporary file beside the target and renamed over it (``core.atomic``), so a crash
mid-write leaves the previous checkpoint whole. The file carries its own digest, ``sha256``: the
SHA-256 of everything else it holds (``state_digest``: every value in order, each tensor's dtype,
shape and bytes), written in the same file, so the one rename makes both appear together. Every
read (``--resume``'s settings, then the state) checks it: ``torch.load`` does not check the zip's
CRCs, and a tensor overwritten with finite values would otherwise be trusted. A checkpoint without
a digest (written before fastcifar recorded one, or edited) is refused: checkpoints live as long as
a stopped run, and nothing could tell a changed byte.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import io
import json
import math
import os
import random
from pathlib import Path

import numpy as np
import torch

from fastcifar.core import atomic
from fastcifar.core.config import TRAJECTORY_FREE_FIELDS, Config, ConfigError, check_fields, training_settings
from fastcifar.core.names import printable
from fastcifar.core.presets import PRESETS
from fastcifar.core.readfile import open_regular, why
from fastcifar.core.streams import Streams
from fastcifar.models.files import CheckpointError, _check_shapes, host_state, write_atomic
from fastcifar.run.component import Component
from fastcifar.run.report import EpochRecord

STATE_FORMAT = "fastcifar.state/1"
STATE_NAME = "checkpoint.pt"
DIGEST_KEY = "sha256"  # the state's own digest (state_digest), beside the fields it covers
# What a checkpoint holds (save_state); a file without one of them is refused by name.
STATE_KEYS = (
    "format",
    "config",
    "world_size",
    "epochs_done",
    "steps_per_epoch",
    "model",
    "optimizer",
    "schedule_step",
    "records",
    "ranks",
)
# What a run writes beside its checkpoint (core.atomic's temporaries of these are its own to clear)
RUN_FILES = ("summary.json", "model*.safetensors", "sparse-run*.json")


def _rng_state() -> dict:
    keys, pos, has_gauss, gauss = np.random.get_state()[1:]
    return {
        "torch": torch.get_rng_state(),
        # this rank's own device only: a resume may see another number of GPUs per process
        "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_initialized() else [],
        "numpy": (torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
        "python": random.getstate(),
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"][0])  # the current device: train.py set it per rank
    keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])


def _gist(exc: Exception) -> str:
    """One short line from an exception whose message may span many (torch.load's do)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    line = next((line for line in lines if "error:" in line.lower()), lines[0] if lines else "")
    return f"{type(exc).__name__}: {line[:160]}"


def save_state(path, *, cfg: Config, ctx, epochs_done: int, model, opt, schedule, hooks, loader, records) -> None:
    """Every rank calls this after epoch ``epochs_done`` (its evaluation included); rank 0 writes."""
    mine = {
        "rng": _rng_state(),
        "hooks": hooks.state_dict(),
        "loader": {"seed": int(loader.streams.run), "streams": loader.streams.as_dict(), "epoch": int(loader.epoch)},
    }
    ranks = [mine]
    if ctx.distributed:
        import torch.distributed as dist

        ranks = [None] * ctx.world_size if ctx.is_main else None
        dist.gather_object(mine, ranks, dst=0)
    if not ctx.is_main:
        return
    state = {
        "format": STATE_FORMAT,
        "config": json.dumps(training_settings(cfg), sort_keys=True),
        "world_size": ctx.world_size,
        "epochs_done": epochs_done,
        "steps_per_epoch": len(loader),
        "model": host_state(model),
        "optimizer": opt.state_dict(),
        "schedule_step": int(schedule.counter.item()),
        "records": [dataclasses.asdict(r) for r in records],
        "ranks": ranks,
        "torch": str(torch.__version__),
    }
    buffer = io.BytesIO()
    torch.save(seal(state), buffer)
    write_atomic(path, buffer.getvalue())


def _feed(h, value) -> None:
    """``value`` into the hash ``h``, tagged by type so that 1, 1.0, "1" and [1] differ."""
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's bytes, not a copy of them
    elif isinstance(value, dict):
        h.update(b"D%d" % len(value))
        for k, v in value.items():  # in order: torch.load keeps a dict's order, and so does this
            _feed(h, k)
            _feed(h, v)
    elif isinstance(value, (list, tuple)):
        h.update(b"%s%d" % (b"L" if isinstance(value, list) else b"U", len(value)))
        for v in value:
            _feed(h, v)
    elif isinstance(value, str):
        b = value.encode("utf-8", "surrogatepass")
        h.update(b"S%d:" % len(b) + b)
    elif value is None or isinstance(value, (bool, int, float)):
        h.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, (torch.dtype, torch.device)):  # weights_only loads these too
        h.update(f"{type(value).__name__}:{value};".encode())
    else:  # weights_only loads nothing else; a writer's mistake otherwise
        raise TypeError(f"cannot digest a {type(value).__name__}")


def state_digest(state: dict) -> str:
    """SHA-256 of a training state's every field but the digest itself, values in order."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in state.items() if k != DIGEST_KEY})
    return h.hexdigest()


def seal(state: dict) -> dict:
    """``state`` with its digest (``state_digest``) under ``DIGEST_KEY``."""
    return {**{k: v for k, v in state.items() if k != DIGEST_KEY}, DIGEST_KEY: state_digest(state)}


def load_state(path, cfg: Config, ctx) -> dict:
    """The training state of ``path``, checked against this run's settings and rank count;
    CheckpointError (one line, on every rank) otherwise. ``restore`` then puts it into the run's
    objects. Rank 0 reads the file and sends it to the others: rank 0 alone wrote it, into its own
    node's --out-dir, which ranks on other nodes may not see."""
    return _on_rank0(ctx, lambda: _read_state(path, cfg, ctx.world_size))


def _on_rank0(ctx, read):
    """``read()`` on rank 0 alone, and its answer, or its CheckpointError, on every rank (each
    raises the same one line)."""
    if not ctx.distributed:
        return read()
    import torch.distributed as dist

    payload = [None]
    if ctx.is_main:
        try:
            payload = [(read(), "")]
        except CheckpointError as exc:
            payload = [(None, str(exc))]
    dist.broadcast_object_list(payload, src=0, device=ctx.device if ctx.device.type == "cuda" else None)
    answer, error = payload[0]
    if error:
        raise CheckpointError(error)
    return answer


def _read_archive(path: Path) -> bytes | None:
    """The bytes of a torch.save zip; None when the file does not end as a zip does (its end of
    central directory record, in the last 64 KiB + 22 bytes), read whole only when it does: a 1 TB
    sparse file of zeros named checkpoint.pt is refused after reading that tail, not by filling
    the memory."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size - (1 << 16) - 22))
        if b"PK\x05\x06" not in f.read():
            return None
        f.seek(0)
        return f.read()


def _load_checked(path, stale_too: bool = False) -> dict:
    """The state in the checkpoint file ``path``, its format and digest checked; CheckpointError
    (one line) otherwise. One read (``read_regular``: a FIFO or a device is refused, never waited
    on), and the bytes digested are the bytes loaded. ``stale_too``: once the file is read, clear
    the temporaries a killed writer left beside it (also when its contents then turn out unusable)."""
    path = Path(path)
    try:
        blob = _read_archive(path)  # the OS's reason for a FIFO, a folder, no permission; never a blocking open
    except FileNotFoundError:
        raise CheckpointError(f"--resume {path}: no such checkpoint file") from None
    except OSError as exc:
        hint = f" (did you mean {path / STATE_NAME}?)" if path.is_dir() else ""
        raise CheckpointError(f"--resume {path}: cannot read checkpoint: {why(exc)}{hint}") from None
    if stale_too:  # the run that wrote it was stopped, maybe by SIGKILL mid-write
        atomic.remove_stale(path.parent, (glob.escape(path.name), *RUN_FILES))
    if blob is None:
        raise CheckpointError(f"--resume {path}: not a readable checkpoint (not a zip archive, as torch.save writes)")
    try:
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, foreign pickle, garbage: all unusable
        raise CheckpointError(f"--resume {path}: not a readable checkpoint ({_gist(exc)})") from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise CheckpointError(f"--resume {path}: not a fastcifar training checkpoint (expected {STATE_FORMAT})")
    if DIGEST_KEY not in state:
        raise CheckpointError(
            f"--resume {path}: this checkpoint carries no digest (written before fastcifar recorded "
            f"one, or edited), so a changed byte could not be told; start the run afresh"
        )
    try:
        same = state[DIGEST_KEY] == state_digest(state)
    except TypeError:
        same = False
    if not same:
        raise CheckpointError(
            f"--resume {path}: its contents do not match the digest written with them (sha256): the "
            f"file changed after it was written (a damaged disk or copy, or an edit); refusing to resume from it"
        )
    return state


def _read_state(path, cfg: Config, world_size: int) -> dict:
    path = Path(path)
    state = _load_checked(path, stale_too=True)
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"--resume {path}: field {missing[0]} is missing")
    try:
        saved = json.loads(state["config"]) if isinstance(state["config"], str) else None
    except ValueError:
        saved = None
    if not isinstance(saved, dict):
        raise CheckpointError(f"--resume {path}: field config is not the JSON of a config")
    now = json.loads(json.dumps(training_settings(cfg), sort_keys=True))
    saved = {**_new_field_defaults(saved), **saved}  # a field added since the checkpoint: its default
    differ = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if differ:
        k = differ[0]
        raise CheckpointError(
            f"--resume {path}: written with --{k.replace('_', '-')} {saved.get(k)}, this run "
            f"has {now.get(k)}" + (f" (and {len(differ) - 1} more settings differ)" if len(differ) > 1 else "")
        )
    if not _is_int(state["world_size"]):
        raise CheckpointError(f"--resume {path}: field world_size is {state['world_size']!r}, not a rank count")
    if state["world_size"] != world_size:
        raise CheckpointError(
            f"--resume {path}: written by {state['world_size']} ranks, this run has {world_size} "
            f"(each rank's shard depends on the count)"
        )
    _check_progress(state, cfg, f"--resume {path}")
    return state


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_progress(state: dict, cfg: Config, where: str) -> None:
    """Every field a resume reads, type- and range-checked against this run, so a tampered file
    is one line (CheckpointError naming the field) before anything is written; unchecked,
    epochs_done 99 of a 3-epoch run trained nothing and wrote a model, -1 a traceback."""

    def bad(name: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{where}: field {name} {problem}")

    epochs = math.ceil(cfg.epochs)  # a fractional --epochs cuts the last one short
    done = state["epochs_done"]
    if not _is_int(done) or not 0 <= done < epochs:
        raise bad(
            "epochs_done",
            f"is {done!r}, this run has {epochs} epochs: it must lie in 0..{epochs - 1}"
            + (" (nothing left to train)" if _is_int(done) and done >= epochs else ""),
        )
    steps = state["steps_per_epoch"]
    if not _is_int(steps) or steps < 1:
        raise bad("steps_per_epoch", f"is {steps!r}, not a positive step count")
    if not _is_int(state["schedule_step"]) or state["schedule_step"] != done * steps:
        raise bad(
            "schedule_step", f"is {state['schedule_step']!r}, {done} epochs of {steps} steps end at step {done * steps}"
        )
    records = state["records"]
    if not isinstance(records, list) or len(records) != done:
        raise bad(
            "records",
            f"holds {len(records) if isinstance(records, list) else type(records).__name__} "
            f"entries, expected one per epoch done ({done})",
        )
    names = {f.name for f in dataclasses.fields(EpochRecord)}
    for i, record in enumerate(records):
        # numbers throughout; the fields a resume reads (the epoch, the train clock) finite too: a
        # legitimate run may record a non-finite test loss (fp16 logits), which the guard allows
        if (
            not isinstance(record, dict)
            or set(record) != names
            or record["epoch"] != i + 1
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in record.values())
            or not math.isfinite(record["total_train_time"])
        ):
            raise bad("records", f"entry {i} is not the record of epoch {i + 1}")
    ranks = state["ranks"]
    if not isinstance(ranks, list) or len(ranks) != state["world_size"]:
        raise bad(
            "ranks",
            f"holds {len(ranks) if isinstance(ranks, list) else type(ranks).__name__} entries, "
            f"expected one per rank ({state['world_size']})",
        )
    for r, mine in enumerate(ranks):
        if (
            not isinstance(mine, dict)
            or not {"rng", "hooks", "loader"} <= set(mine)
            or not isinstance(mine["rng"], dict)
            or not isinstance(mine["hooks"], dict)
            or not isinstance(mine["loader"], dict)
        ):
            raise bad("ranks", f"entry {r} is not a rank's state (rng, hooks, loader)")
        seed, epoch = mine["loader"].get("seed"), mine["loader"].get("epoch")
        if not _is_int(seed) or seed != cfg.seed:  # --resume holds run 1, seeded --seed
            raise bad("ranks", f"entry {r}: loader seed {seed!r}, this run's is {cfg.seed}")
        if not _is_int(epoch) or not 0 <= epoch <= done:
            raise bad("ranks", f"entry {r}: loader epoch {epoch!r}, expected 0..{done}")
        streams, expected = mine["loader"].get("streams"), Streams.for_run(cfg, cfg.seed).as_dict()
        if streams is not None and streams != expected:  # a checkpoint without them: derived from its settings
            raise bad("ranks", f"entry {r}: loader streams {streams!r}, this run's are {expected}")
    model = state["model"]
    if not isinstance(model, dict) or not all(
        isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in model.items()
    ):
        raise bad("model", "is not a dict of named tensors")
    for name, t in model.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise bad("model", f"{name} holds NaN or infinite values")
    if not isinstance(state["optimizer"], dict):
        raise bad("optimizer", "is not an optimizer state")


def _new_field_defaults(saved: dict) -> dict:
    """Training fields a checkpoint's config lacks (added since it was written), at their defaults:
    the run it continues had them off."""
    base = json.loads(json.dumps(training_settings(Config()), sort_keys=True))
    return {k: v for k, v in base.items() if k not in saved}


def _plain(value):
    return json.loads(json.dumps(value))


def resume_settings(cfg: Config, given: dict, ctx=None) -> Config:
    """``--resume CHECKPOINT`` on the command line: the checkpoint's training settings, with the
    command line's where-and-what-to-log fields (config.TRAJECTORY_FREE_FIELDS). An option given
    explicitly (``given``: field -> value) must agree with the checkpoint: CheckpointError, one line
    naming the option and both values, otherwise. A file that cannot be read leaves ``cfg`` alone:
    ``load_state`` then says what is wrong with it. With several ranks rank 0 reads the file (ranks
    on other nodes may not see its --out-dir, as in ``load_state``) and sends every rank the same
    settings or the same refusal. The Python API (``fastcifar.train(cfg)``) does not come here: its
    ``cfg`` must match the checkpoint (``load_state`` checks)."""
    if ctx is None or not ctx.distributed:
        return _resume_settings(cfg, given)
    settings = _on_rank0(ctx, lambda: _resume_settings(cfg, given))
    # rank 0's training settings; where things are and what is logged stay this rank's own
    return dataclasses.replace(settings, **{k: getattr(cfg, k) for k in TRAJECTORY_FREE_FIELDS})


def _resume_settings(cfg: Config, given: dict) -> Config:
    path = Path(cfg.resume)
    try:
        saved = json.loads(_load_checked(path)["config"])
        if not isinstance(saved, dict):
            return cfg
    except (CheckpointError, KeyError, TypeError, ValueError):  # load_state says what is wrong, in one line
        return cfg
    saved = {**_new_field_defaults(saved), **saved}
    known = {f.name: f for f in dataclasses.fields(Config)}
    for name, value in sorted(given.items()):
        if name in saved and _plain(value) != saved[name]:
            flag = "--" + name.replace("_", "-")
            shown = ",".join(map(str, saved[name])) if isinstance(saved[name], list) else saved[name]
            mine = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
            raise CheckpointError(
                f"--resume {path}: written with {flag} {shown}, this run has {mine} (given on "
                f"the command line; leave it out to continue with the checkpoint's)"
            )
    settings = {
        k: (tuple(v) if isinstance(known[k].default, tuple) and isinstance(v, list) else v)
        for k, v in saved.items()
        if k in known
    }
    resumed = dataclasses.replace(cfg, **settings)
    if resumed.preset not in PRESETS:  # the command line takes only these; it names the run's folder
        raise CheckpointError(
            f"--resume {path}: field config holds preset {printable(repr(resumed.preset)[:60])}, not one of "
            f"{', '.join(PRESETS)} (from the checkpoint, not this command line)"
        )
    try:  # a value the user never typed is named as the checkpoint's, not as a flag of this command line
        check_fields(resumed)
    except ConfigError as exc:
        raise CheckpointError(
            f"--resume {path}: field config holds an unusable setting (from the checkpoint, not this "
            f"command line): {str(exc).removeprefix('--')}"
        ) from None
    return resumed


def restore(state: dict, *, ctx, model, opt, schedule, hooks, loader, source: str = "checkpoint") -> tuple[int, list]:
    """Put a checked state into the run's objects, in place (captured graphs hold them).
    Returns (epochs done, the epoch records so far, as dicts)."""
    if state["steps_per_epoch"] != len(loader):
        raise CheckpointError(
            f"--resume {source}: {state['steps_per_epoch']} steps per epoch, this run's data "
            f"gives {len(loader)} (a different data set?)"
        )
    _check_shapes(model.state_dict(), state["model"], f"--resume {source}")
    for name, t in model.state_dict().items():  # fp32 from a CPU run vs fp16 on a GPU (--precision auto)
        if state["model"][name].dtype != t.dtype:
            raise CheckpointError(
                f"--resume {source}: written with {state['model'][name].dtype} weights ({name}), "
                f"this run trains in {t.dtype}; pass the writer's --precision and --device"
            )
    mine = state["ranks"][ctx.rank]
    try:
        with torch.no_grad():
            for name, t in model.state_dict().items():
                t.copy_(state["model"][name])
        opt.load_state_dict(state["optimizer"])
        hooks.load_state_dict(mine["hooks"])
    except (ValueError, RuntimeError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise CheckpointError(f"--resume {source}: {_gist(exc)}") from None
    schedule.reset(state["schedule_step"])
    streams = mine["loader"].get("streams")
    loader.set_epoch(mine["loader"]["seed"] if streams is None else Streams(**streams), mine["loader"]["epoch"])
    try:
        _set_rng_state(mine["rng"])
    except (ValueError, RuntimeError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise CheckpointError(
            f"--resume {source}: field ranks: entry {ctx.rank}'s rng state is unusable ({_gist(exc)})"
        ) from None
    return state["epochs_done"], state["records"]


class Checkpoints(Component):
    """``--resume`` and ``--checkpoint-every`` as a run's component. ``parts``: the run's objects a
    state covers (ctx, model, opt, schedule, hooks, loader); ``resume``: a checked state
    (``load_state``) or None; ``every``: save after every this many epochs (0: never), off the
    clock, every rank taking part (its RNGs and lookahead copy), rank 0 writing."""

    def __init__(self, cfg: Config, log, parts: dict, epochs: int, resume: dict | None, every: int):
        self.cfg, self.log, self.parts, self.epochs = cfg, log, parts, epochs
        self.resume, self.every = resume, every
        self.result = None

    def start(self, result) -> int | None:
        """Weights, momentum, schedule, lookahead, RNGs, loader: as after the checkpoint's epoch."""
        self.result = result
        if self.every and self.every >= self.epochs:
            self.log.line(
                f"note: --checkpoint-every {self.every} with {self.epochs} epochs writes no checkpoint "
                f"(none is written after the last epoch: the model file holds that)"
            )
        if self.resume is None:
            return None
        start_epoch, records = restore(self.resume, source=self.cfg.resume, **self.parts)
        result.epochs = [EpochRecord(**r) for r in records]
        self.log.line(f"resumed from {self.cfg.resume} after epoch {start_epoch}")
        return start_epoch

    def epoch_done(self, epoch: int, record) -> None:
        if self.every and (epoch + 1) % self.every == 0 and epoch + 1 < self.epochs:
            path = self.log.dir and self.log.dir / STATE_NAME
            save_state(path, cfg=self.cfg, epochs_done=epoch + 1, records=self.result.epochs, **self.parts)
            if path:  # rank 0, which wrote it
                self.log.line(f"checkpoint: {path} (after epoch {epoch + 1})")
