"""The training loader a run gets: which one (``resolve_loader``: ``--loader`` and the device) and
built (``make_train_loader``: the torch loader or DALI's, N side by side for ``--emulate-ranks``).

The one module that knows both loaders: neither ``loader.py`` nor ``dali.py`` imports it, or the
other's loader class, so a change to one loader's constructor is a change there and here only.
"""

from __future__ import annotations

import numpy as np
import torch

from fastcifar.core.config import CHOICES
from fastcifar.data import dali, rank_shard
from fastcifar.data.dali import DaliLoader, DaliUnavailableError
from fastcifar.data.loader import EmulatedRanks, TorchLoader, TrainLoader
from fastcifar.ops.augment import AugmentSpec

LOADERS = CHOICES["loader"]
# What "auto" picks per device type: the faster in bench/bench_loader.py (bench/results/loader.jsonl,
# the images_per_s rows). On the CPU DALI is several times faster than the torch ops; on a GPU the
# torch loader is about ten times faster than DALI, whose per-batch Python feed of 5 external
# sources (7 with the jitter) and output hand-over cost host time the GPU waits for
# (bench/results/visits/visit-4.md, 4b).
AUTO_LOADER = {"cuda": "torch", "cpu": "dali"}


def resolve_loader(requested: str, device: torch.device | str) -> tuple[str, str | None]:
    """The loader to use ("dali" or "torch") and a one-line notice when "auto" had to fall back.

    An explicit "dali" without a working DALI raises ``DaliUnavailableError`` (one line).
    """
    if requested not in LOADERS:
        raise ValueError(f"--loader must be one of {', '.join(LOADERS)}, not {requested!r}")
    if requested == "torch":
        return "torch", None
    ok, why = dali.dali_available()
    if requested == "dali":
        if not ok:
            raise DaliUnavailableError(
                f"--loader dali: NVIDIA DALI cannot be imported ({why}); "
                "install it with the extra README's Install table gives for your GPU ('.[dali]', on a V100 "
                "'.[volta]') or use --loader torch"
            )
        return "dali", None
    choice = AUTO_LOADER[torch.device(device).type]
    if choice == "dali" and not ok:
        return "torch", f"note: DALI unavailable ({why}); using the torch loader"
    return choice, None


def make_train_loader(
    name: str,
    images,
    labels,
    shard: np.ndarray,
    batch_size: int,
    steps: int,
    *,
    augment: AugmentSpec,
    kernels: str,
    dtype: torch.dtype,
    device: torch.device,
    rank: int = 0,
    emulate_ranks: int = 1,
    index: np.ndarray | None = None,
    n_read: int | None = None,
) -> TrainLoader:
    """The training loader ``resolve_loader`` chose: ``DaliLoader`` or ``TorchLoader`` (which
    augments with ``kernels``: the Triton kernel or the reference). ``emulate_ranks`` N > 1 (one
    process): N of them side by side (``loader.EmulatedRanks``), rank r's over its part of
    ``shard`` (``rank_shard``: the whole set's shard r of N, as under torchrun) with
    ``batch_size / N`` images a step. ``index``: each image's data-set index in 0..``n_read``-1,
    the training set as read (``Dataset.index``, ``Dataset.n_read``; default: the images are all of it)."""
    index = np.arange(len(labels)) if index is None else index
    n_read = len(labels) if n_read is None else n_read
    if emulate_ranks > 1:
        if rank:
            raise ValueError("emulated ranks run in one process, rank 0 of 1")
        per_rank = batch_size // emulate_ranks
        return EmulatedRanks(
            [
                make_train_loader(
                    name,
                    images,
                    labels,
                    shard[rank_shard(index[shard], n_read, r, emulate_ranks)],
                    per_rank,
                    steps,
                    augment=augment,
                    kernels=kernels,
                    dtype=dtype,
                    device=device,
                    rank=r,
                    index=index,
                    n_read=n_read,
                )
                for r in range(emulate_ranks)
            ]
        )
    if name == "dali":
        return DaliLoader(
            images,
            labels,
            shard,
            batch_size,
            steps,
            augment=augment,
            dtype=dtype,
            device=device,
            rank=rank,
            index=index,
            n_read=n_read,
        )
    return TorchLoader(
        images,
        labels,
        shard,
        batch_size,
        steps,
        augment=augment,
        dtype=dtype,
        device=device,
        rank=rank,
        kernels=kernels,
        index=index,
        n_read=n_read,
    )
