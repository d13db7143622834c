"""What a run keeps: the trained model, and the training state a stopped run resumes from.

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

``save_model`` / ``load_model`` (and their halves ``save_weights``, ``read_model_file``,
``network_from_weights``) are the only writer and reader: the trainer, ``evaluate``, ``predict``,
the API and the sparse diffs' base and restored files all use them.

Training state (``checkpoint.pt``, format ``fastcifar.state/1``), written at an epoch's end:
weights and batchnorm statistics, momentum buffers and per-group rate multipliers, the schedule's
step, the lookahead's slow copy, every RNG, the loader's (seed, epoch), and the epoch records so
far. Rank-local parts (RNGs, the lookahead copy, whose batchnorm entries follow each rank's own
batches) are gathered to rank 0, which writes one file; every rank reads it and takes its own
entry. A torch pickle read with ``weights_only=True``: tensors and plain containers only.

Both are written to a temporary file in the target's folder and renamed over it, so a crash
mid-write leaves the previous file whole.
"""

from __future__ import annotations

import dataclasses
import io
import json
import random
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from . import report
from .config import Config
from .data import DataError

MODEL_FORMAT = "fastcifar.model/1"
STATE_FORMAT = "fastcifar.state/1"
MODEL_NAME = "model.safetensors"
STATE_NAME = "checkpoint.pt"
# Fields a resumed run may change: where things are, what is logged. Every other field shapes the
# training trajectory, so a checkpoint written under another value is refused.
RESUME_FREE_FIELDS = ("data", "download", "download_set", "cache_dir", "out_dir", "resume", "checkpoint_every",
                      "save_model", "nvtx", "profile_steps", "dist_timeout_s", "target_acc", "eval_batch_size",
                      "quiet")


class CheckpointError(DataError):
    """A model or checkpoint file that cannot be used: one line, exit 2."""


def write_atomic(path: str | Path, blob: str | bytes) -> Path:
    """``report.write_atomic`` for a model, state or sparse-record file (bytes or text). The content
    is built in memory first, so a full disk surfaces here as an OSError: one line
    (CheckpointError), exit 2."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return report.write_atomic(path, blob)
    except OSError as exc:
        raise CheckpointError(f"cannot write {path}: {exc.strerror or type(exc).__name__}") from None


def config_from_dict(values: dict) -> Config:
    """A Config from ``asdict`` output: JSON lists back to tuples; unknown keys (a newer writer's)
    are dropped, missing ones take their defaults."""
    known = {f.name: f for f in fields(Config)}
    kwargs = {}
    for name, value in values.items():
        if name in known:
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


def save_weights(path, tensors: dict, cfg: Config, classes, test_acc: float | None, mean, std) -> Path:
    """``save_model`` for a state dict already on the host (contiguous CPU tensors): the sparse
    diffs' base and restored files (fastcifar.sparse.diffs) are model files written here too."""
    from safetensors.torch import save
    metadata = {"format": MODEL_FORMAT, "config": json.dumps(dataclasses.asdict(cfg)),
                "classes": json.dumps(list(classes)), "mean": json.dumps([float(m) for m in mean]),
                "std": json.dumps([float(s) for s in std]), "test_acc": "" if test_acc is None else str(float(test_acc)),
                "torch": str(torch.__version__)}
    return write_atomic(path, save(tensors, metadata=metadata))


def load_model(path, device: str | torch.device = "cpu") -> tuple[torch.nn.Module, ModelInfo]:
    """The network of a model file, in eval mode, fp32, on ``device``; CheckpointError (one line)
    for a missing, corrupt, truncated or foreign file."""
    tensors, meta = read_model_file(path)
    return network_from_weights(tensors, meta, str(path), device)


def read_safetensors(path, what: str = "model file") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (on the CPU) and string metadata of a safetensors file (``what``, for the
    error), in one read."""
    from safetensors import safe_open
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such {what}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in f.keys()}, f.metadata() or {}
    except Exception as exc:  # safetensors reports a damaged header or short file in several types
        raise CheckpointError(f"{path}: not a readable {what} ({type(exc).__name__}: {exc})") from None


def read_model_file(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors, meta = read_safetensors(path)
    if meta.get("format") != MODEL_FORMAT:
        raise CheckpointError(f"{path}: not a fastcifar model file (format {meta.get('format')!r}, "
                              f"expected {MODEL_FORMAT!r})")
    return tensors, meta


def model_info(meta: dict[str, str], source: str) -> ModelInfo:
    """A model file's metadata, parsed; CheckpointError if any of it is missing or malformed."""
    try:
        return ModelInfo(config_from_dict(json.loads(meta["config"])), tuple(json.loads(meta["classes"])),
                         tuple(json.loads(meta["mean"])), tuple(json.loads(meta["std"])),
                         float(meta["test_acc"]) if meta.get("test_acc") else None)
    except Exception as exc:
        raise CheckpointError(f"{source}: unusable metadata ({type(exc).__name__}: {exc})") from None


def network_from_weights(tensors: dict[str, torch.Tensor], meta: dict[str, str], source: str,
                         device: str | torch.device = "cpu") -> tuple[torch.nn.Module, ModelInfo]:
    """The network a model file's tensors and metadata describe (``load_model`` without the
    read: a sparse-diff chain restores its tensors in memory)."""
    from . import recipe
    from .model import norm_blocks
    device = torch.device(device)
    info = model_info(meta, source)
    try:
        model = recipe.make_network(info.config, norm_blocks("auto", device), len(info.classes))
    except Exception as exc:
        raise CheckpointError(f"{source}: unusable metadata ({type(exc).__name__}: {exc})") from None
    _check_shapes(model.state_dict(), tensors, source)
    model.load_state_dict(tensors)
    return model.to(device=device, memory_format=torch.channels_last).eval(), info


def _check_shapes(want: dict, got: dict, source: str) -> None:
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        raise CheckpointError(f"{source}: tensors do not match the model (missing: {missing[:3] or 'none'}; "
                              f"unexpected: {extra[:3] or 'none'})")
    for name, t in want.items():
        if tuple(got[name].shape) != tuple(t.shape):
            raise CheckpointError(f"{source}: {name} has shape {tuple(got[name].shape)}, "
                                  f"the model's is {tuple(t.shape)}")


def model_path(run_dir, run: int, runs: int) -> Path:
    """``model.safetensors`` for a single run, ``model-run<N>.safetensors`` for several."""
    return Path(run_dir) / (MODEL_NAME if runs == 1 else f"model-run{run}.safetensors")


# ---------------------------------------------------------------------------------------------
# The training state

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
    if not path.is_file():
        raise CheckpointError(f"--resume {path}: no such checkpoint file")
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


if __name__ == "__main__":  # python -m fastcifar.checkpoint inspect|restore: sparse diff chains
    from fastcifar.sparse.diffs import main
    sys.exit(main(prog="python -m fastcifar.checkpoint"))
