"""How a run's gradients meet across ranks, chosen once from the settings: not at all (one
process, or local SGD, which merges weights instead), stock ``DistributedDataParallel`` (``--comm
ddp``), or this project's buckets all-reduced during backward (``--comm bucketed``, ``comm.py``),
optionally compressed (``compress/``). The trainer builds one ``GradientSync`` per run and never
asks which it got."""

from __future__ import annotations

import inspect

import torch
from torch.nn.parallel import DistributedDataParallel

from fastcifar.parallel import compress
from fastcifar.parallel.comm import GradBuckets

# DDP without buffer broadcasts (each rank's batchnorm statistics stay its own until averaged per
# epoch): torch >= 2.13 names it forward_sync_buffers and warns on every rank about the old name.
_DDP_OWN_BUFFERS = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


class GradientSync:
    """``net``: what the step calls (the model, or DDP around it); ``buckets``: the gradient buckets
    the step finishes before the optimizer (None unless --comm bucketed with several ranks);
    ``lines``: what to log about it once."""

    def __init__(self, model: torch.nn.Module, cfg, ctx, seed: int):
        self.net, self.buckets, self.lines = model, None, []
        if not ctx.distributed or cfg.local_steps:  # local SGD (run.sparse) merges weights instead
            return
        if cfg.comm == "ddp":
            self.net = DistributedDataParallel(
                model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None, **_DDP_OWN_BUFFERS
            )
            return
        # gradients become views into flat buckets, all-reduced during backward
        self.buckets = GradBuckets(
            model.parameters(), cfg.bucket_mb, compression=compress.from_config(cfg, ctx, seed)
        )  # None: plain all-reduce
        self.lines.append(self.buckets.describe())
        if self.buckets.compression is not None:
            self.lines.append(self.buckets.compression.describe())

    @property
    def compression(self):
        return self.buckets.compression if self.buckets is not None else None

    def reset(self) -> None:
        """After the warm-up steps: error-feedback residuals, compression RNG and counts as new."""
        if self.buckets is not None:
            self.buckets.reset()

    def remove(self) -> None:
        """The run's model outlives the run: drop the hooks (the buckets and residuals go with them)."""
        if self.buckets is not None:
            self.buckets.remove()


def capture_blocker(cfg, world_size: int, grouped: bool | None = None) -> tuple[str, str]:
    """Why this run's gradient sync cannot be captured as a CUDA graph: (the refusal of
    ``--cuda-graphs on``, the note logged when ``auto`` turns capture off); ("", "") when it can.
    A rank without a process group syncs nothing, so only a group can block capture; ``grouped``:
    whether there is one (default: several ranks; ``--dist-group always`` gives one rank one too)."""
    if not (world_size > 1 if grouped is None else grouped):
        return "", ""
    if cfg.comm == "ddp":
        return (
            "--cuda-graphs on needs --comm bucketed with several ranks "
            "(DistributedDataParallel's reducer cannot be captured)"
        ), ""
    why = compress.why_not_capturable(cfg)
    if why:
        return (
            f"--cuda-graphs on cannot capture this step: {why}; use --cuda-graphs off",
            f"note: CUDA graphs off: {why}",
        )
    return "", ""
