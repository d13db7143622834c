"""The training state a stopped run resumes from: one function saves it, one loads and checks it,
one puts it back into the run's objects.

Training state (``checkpoint.pt``, format ``fastcifar.state/1``), written at an epoch's end:
weights and batchnorm statistics, momentum buffers and per-group rate multipliers, the schedule's
step, the lookahead's slow copy, every RNG, the loader's (seed, epoch), and the epoch records so
far. Rank-local parts (RNGs, the lookahead copy, whose batchnorm entries follow each rank's own
batches) are gathered to rank 0, which writes one file; every rank reads it and takes its own
entry. A torch pickle read with ``weights_only=True``: tensors and plain containers only.

Written to a temporary file beside the target and renamed over it (``core.atomic``), so a crash
mid-write leaves the previous checkpoint whole.
"""

from __future__ import annotations

import dataclasses
import glob
import io
import json
import random
from pathlib import Path

import numpy as np
import torch

from fastcifar.core import atomic
from fastcifar.core.config import Config
from fastcifar.core.readfile import check_regular, why
from fastcifar.models.files import CheckpointError, _check_shapes, host_state, write_atomic

STATE_FORMAT = "fastcifar.state/1"
STATE_NAME = "checkpoint.pt"
# What a run writes beside its checkpoint (core.atomic's temporaries of these are its own to clear)
RUN_FILES = ("summary.json", "model*.safetensors", "sparse-run*.json")
# Fields a resumed run may change: where things are, what is logged. Every other field shapes the
# training trajectory, so a checkpoint written under another value is refused.
RESUME_FREE_FIELDS = ("data", "download", "download_set", "cache_dir", "out_dir", "resume", "checkpoint_every",
                      "save_model", "nvtx", "profile_steps", "dist_timeout_s", "target_acc", "eval_batch_size",
                      "quiet")


def _rng_state() -> dict:
    keys, pos, has_gauss, gauss = np.random.get_state()[1:]
    return {"torch": torch.get_rng_state(),
            # this rank's own device only: a resume may see another number of GPUs per process
            "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_initialized() else [],
            "numpy": (torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
            "python": random.getstate()}


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


def _training_config(cfg: Config) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RESUME_FREE_FIELDS}


def save_state(path, *, cfg: Config, ctx, epochs_done: int, model, opt, schedule, hooks, loader, records) -> None:
    """Every rank calls this after epoch ``epochs_done`` (its evaluation included); rank 0 writes."""
    mine = {"rng": _rng_state(), "hooks": hooks.state_dict(),
            "loader": {"seed": int(loader.run_seed),
                       "epoch": int(loader.epoch)}}
    ranks = [mine]
    if ctx.distributed:
        import torch.distributed as dist
        ranks = [None] * ctx.world_size if ctx.is_main else None
        dist.gather_object(mine, ranks, dst=0)
    if not ctx.is_main:
        return
    state = {"format": STATE_FORMAT, "config": json.dumps(_training_config(cfg), sort_keys=True),
             "world_size": ctx.world_size, "epochs_done": epochs_done, "steps_per_epoch": len(loader),
             "model": host_state(model),
             "optimizer": opt.state_dict(), "schedule_step": int(schedule.counter.item()),
             "records": [dataclasses.asdict(r) for r in records], "ranks": ranks, "torch": str(torch.__version__)}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_atomic(path, buffer.getvalue())


def load_state(path, cfg: Config, ctx) -> dict:
    """The training state of ``path``, checked against this run's settings and rank count;
    CheckpointError (one line, on every rank) otherwise. ``restore`` then puts it into the run's
    objects. Rank 0 reads the file and sends it to the others: rank 0 alone wrote it, into its own
    node's --out-dir, which ranks on other nodes may not see."""
    if not ctx.distributed:
        return _read_state(path, cfg, ctx.world_size)
    import torch.distributed as dist
    payload = [None]
    if ctx.is_main:
        try:
            payload = [(_read_state(path, cfg, ctx.world_size), "")]
        except CheckpointError as exc:
            payload = [(None, str(exc))]
    dist.broadcast_object_list(payload, src=0, device=ctx.device if ctx.device.type == "cuda" else None)
    state, error = payload[0]
    if error:
        raise CheckpointError(error)
    return state


def _read_state(path, cfg: Config, world_size: int) -> dict:
    path = Path(path)
    try:
        check_regular(path)  # the OS's reason for a FIFO, a folder, no permission; never a blocking open
    except FileNotFoundError:
        raise CheckpointError(f"--resume {path}: no such checkpoint file") from None
    except OSError as exc:
        raise CheckpointError(f"--resume {path}: cannot read checkpoint: {why(exc)}") from None
    # the run that wrote it was stopped, maybe by SIGKILL mid-write: clear its stale temporaries
    atomic.remove_stale(path.parent, (glob.escape(path.name), *RUN_FILES))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, foreign pickle, garbage: all unusable
        raise CheckpointError(f"--resume {path}: not a readable checkpoint ({_gist(exc)})") from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise CheckpointError(f"--resume {path}: not a fastcifar training checkpoint (expected {STATE_FORMAT})")
    saved, now = json.loads(state["config"]), json.loads(json.dumps(_training_config(cfg), sort_keys=True))
    differ = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if differ:
        k = differ[0]
        raise CheckpointError(f"--resume {path}: written with --{k.replace('_', '-')} {saved.get(k)}, this run "
                              f"has {now.get(k)}" + (f" (and {len(differ) - 1} more settings differ)"
                                                     if len(differ) > 1 else ""))
    if state["world_size"] != world_size:
        raise CheckpointError(f"--resume {path}: written by {state['world_size']} ranks, this run has {world_size} "
                              f"(each rank's shard depends on the count)")
    return state


def restore(state: dict, *, ctx, model, opt, schedule, hooks, loader, source: str = "checkpoint") -> tuple[int, list]:
    """Put a checked state into the run's objects, in place (captured graphs hold them).
    Returns (epochs done, the epoch records so far, as dicts)."""
    if state["steps_per_epoch"] != len(loader):
        raise CheckpointError(f"--resume {source}: {state['steps_per_epoch']} steps per epoch, this run's data "
                              f"gives {len(loader)} (a different data set?)")
    _check_shapes(model.state_dict(), state["model"], f"--resume {source}")
    for name, t in model.state_dict().items():  # fp32 from a CPU run vs fp16 on a GPU (--precision auto)
        if state["model"][name].dtype != t.dtype:
            raise CheckpointError(f"--resume {source}: written with {state['model'][name].dtype} weights ({name}), "
                                  f"this run trains in {t.dtype}; pass the writer's --precision and --device")
    mine = state["ranks"][ctx.rank]
    try:
        with torch.no_grad():
            for name, t in model.state_dict().items():
                t.copy_(state["model"][name])
        opt.load_state_dict(state["optimizer"])
        hooks.load_state_dict(mine["hooks"])
    except (ValueError, RuntimeError, KeyError) as exc:
        raise CheckpointError(f"--resume {source}: {exc}") from None
    schedule.reset(state["schedule_step"])
    loader.set_epoch(mine["loader"]["seed"], mine["loader"]["epoch"])
    _set_rng_state(mine["rng"])
    return state["epochs_done"], state["records"]
