"""The torch loader: device-resident uint8 images, augmented per batch on the device.

With ``kernels="torch"`` each batch goes through ``fastcifar.ops.augment.augment_reference`` (plain
torch ops, the reference); with ``kernels="triton"`` through one fused Triton kernel that reads
the padded set in place (``kernels/augment.py``).

The training shard is copied to the device once and padded once (50,000 x 40 x 40 x 3 bytes =
240 MB for the whole set), so an epoch moves no images from the host: each batch is a gather of
indices and ``fastcifar.ops.augment`` does the rest. The epoch's order and random parameters come
from ``epoch_plan`` (the run's order and aug streams: ``core.streams``), drawn on the host (the
DALI loader's draws exactly) and copied to the device once per epoch (6 int64 per image, and 2
float32 with the jitter), while the GPU still runs the epoch before (``EpochAhead``).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch

from fastcifar.core.streams import Streams, as_streams, derive
from fastcifar.ops.augment import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    DEFAULT_AUGMENT,
    AugmentParams,
    AugmentSpec,
    augment_reference,
    draw_params,
    normalize,
    pad_images,
)


def epoch_plan(
    seeds: Streams | int,
    rank: int,
    epoch: int,
    n: int,
    spec: AugmentSpec,
    *,
    shard_index: torch.Tensor,
    n_read: int,
    size: int = 32,
):
    """One rank's whole epoch, drawn once on the host: the order (``n`` slots of the rank's shard)
    and every image's augmentation parameters (``spec``'s). Both loaders take their epoch from
    here, so the seeds give the same batches with torch or DALI, on any device (a CUDA generator
    draws other numbers than the CPU one). ``seeds``: the run's ``Streams`` (or a run seed, all
    streams derived from it); ``shard_index`` (CPU int64): each slot's data-set index, in
    0..``n_read``-1 (the training set as read).

    - order: a permutation of the whole training set as read, from the order stream, the rank and
      the epoch, filtered to the shard's images: the same order seed gives the same sequence of
      data-set indices whatever the other seeds, and a subset without some images the same
      sequence without them (every later image moves up, across batch boundaries);
    - augmentation: one draw of ``draw_params`` for every image of the training set as read, from
      the aug stream and the epoch, read at the data-set index: an image gets the same crop, flip,
      cutout and jitter in an epoch whatever the order, the subset, the rank and the rank count.
    Drawing over the whole set costs the host ~1 ms for 50,000 images per epoch (a rank of 8
    draws 8x its share), off the GPU's path (``EpochAhead``)."""
    streams = as_streams(seeds)
    slot = torch.full((n_read,), -1, dtype=torch.int64)
    slot[shard_index] = torch.arange(len(shard_index))
    order_draws = torch.Generator().manual_seed(derive(streams.order, rank, epoch))
    slots = slot[torch.randperm(n_read, generator=order_draws)]
    order = slots[slots >= 0][:n]
    aug_draws = torch.Generator().manual_seed(derive(streams.aug, epoch))
    every = draw_params(n_read, spec, aug_draws, "cpu", size, index=torch.arange(n_read), epoch=epoch, seed=streams.aug)
    return order, every.take(shard_index[order])


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without making the host wait for the GPU: from pinned memory the copy is
    queued behind the work already on the stream (torch's pinned-memory cache keeps the buffer
    until the copy has run). From pageable memory CUDA promises no such thing: the driver stages
    the data first, and a small copy returned early on the H100 but a large one may wait."""
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def plan_to_device(order: torch.Tensor, params: AugmentParams, device: torch.device):
    """An epoch's order and parameters on ``device`` in one copy per dtype: the order with every
    integer parameter (6 int64 per image: 2.4 MB for 50,000), the float ones (the jitter's) in a
    second; none per step."""
    drawn = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if getattr(params, f.name) is not None}
    ints = [name for name, v in drawn.items() if not v.is_floating_point()]
    floats = [name for name in drawn if name not in ints]
    rows = to_device(torch.stack([order, *(drawn[name] for name in ints)]), device)
    on_device = dict(zip(ints, rows[1:], strict=True))
    if floats:
        on_device |= zip(floats, to_device(torch.stack([drawn[name] for name in floats]), device), strict=True)
    return rows[0], AugmentParams(**on_device)


def data_set_index(shard, n_images: int, index: np.ndarray | None, n_read: int | None) -> tuple[torch.Tensor, int]:
    """A loader's keys for ``epoch_plan``: the data-set index of each slot of ``shard`` (CPU int64)
    and the size of the training set as read. ``index``: each of the ``n_images`` images' data-set
    index (None: its position); ``n_read``: None for ``n_images``."""
    shard = torch.as_tensor(np.asarray(shard), dtype=torch.int64)
    keys = shard if index is None else torch.as_tensor(np.asarray(index), dtype=torch.int64)[shard]
    n_read = n_images if n_read is None else n_read
    if len(keys) and (keys.min() < 0 or keys.max() >= n_read):
        raise ValueError(f"data-set indices must lie in 0..{n_read - 1}")
    return keys, n_read


class EpochAhead:
    """One epoch's plan (order and augmentation draws, on the device) made before the epoch starts.

    Why: drawing an epoch on the host at its start left the GPU idle at every epoch start, and
    for tens of milliseconds in some (bench/results/visits/visit-3.md, 3b). The trainer
    asks for the next epoch's plan right after queuing the last step of this one, when the CPU is
    well ahead of the GPU: the drawing overlaps the GPU, still inside this epoch's clock.
    ``take`` returns the plan made ahead when it is the epoch asked for, else draws it then."""

    def __init__(self, make):
        self.make = make  # (streams, epoch) -> the plan
        self.key, self.plan = None, None

    def prepare(self, streams: Streams, epoch: int) -> None:
        self.key, self.plan = (streams, epoch), self.make(streams, epoch)

    def take(self, streams: Streams, epoch: int):
        if self.key != (streams, epoch):
            return self.make(streams, epoch)
        plan, self.key, self.plan = self.plan, None, None
        return plan


class TrainLoader:
    """What the trainer asks of a training loader (``TorchLoader`` here, ``dali.DaliLoader``): the
    rank's fixed shard, ``len`` steps of ``batch_size`` an epoch, reshuffled every epoch from
    the run's streams and the epoch (``epoch_plan``). The optional parts default to nothing, so
    the trainer calls them all."""

    batch_size: int
    steps: int
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        raise NotImplementedError

    def set_epoch(self, seeds: Streams | int, epoch: int) -> None:
        """The epoch the next pass draws: ``seeds`` the run's ``Streams`` (or a run seed, every
        stream derived from it)."""
        self.streams, self.epoch = as_streams(seeds), epoch

    def prepare(self, seeds: Streams | int, epoch: int) -> None:
        """Draw that epoch's plan now, while the device still runs this one (default: at its start)."""

    def plain_images(self, n: int) -> torch.Tensor:
        """The shard's first ``n`` images un-augmented, normalized, fp32, NCHW-shaped."""
        raise NotImplementedError

    def bind_static(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        """The step's input buffers, for a loader that writes each batch into them itself (default:
        the step copies each batch in)."""

    def quiesce(self) -> None:
        """Stop background work that would make CUDA calls during graph capture (default: none)."""

    def first(self, n: int):
        """The first ``n`` batches of the epoch: the loader itself for a whole epoch, so its iterator
        runs to its end (DALI finishes its pass there; a pass left suspended is drained by the next)."""
        return self if n >= len(self) else itertools.islice(self, n)


class TorchLoader(TrainLoader):
    """Training batches of one rank's fixed shard, reshuffled every epoch, last partial batch dropped."""

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        shard: np.ndarray,
        batch_size: int,
        steps_per_epoch: int,
        *,
        augment: AugmentSpec = DEFAULT_AUGMENT,
        dtype: torch.dtype,
        device: torch.device,
        rank: int = 0,
        mean=CIFAR10_MEAN,
        std=CIFAR10_STD,
        kernels: str = "torch",
        index: np.ndarray | None = None,
        n_read: int | None = None,
    ):
        """``index``: each image's data-set index (``Dataset.index``; default its position) in
        0..``n_read``-1, the training set as read (default: ``images`` are all of it)."""
        if steps_per_epoch * batch_size > len(shard):
            raise ValueError(
                f"{steps_per_epoch} steps of {batch_size} need {steps_per_epoch * batch_size} "
                f"images, the shard has {len(shard)}"
            )
        self.augment = augment
        self.images = pad_images(torch.from_numpy(images[shard]).to(device), augment.crop_pad, augment.pad_mode)
        self.labels = torch.from_numpy(labels[shard]).to(device)
        self.batch_size, self.steps = batch_size, steps_per_epoch
        self.dtype, self.device, self.rank = dtype, device, rank
        self.mean = torch.tensor(mean, dtype=torch.float32, device=device)  # once, not per batch
        self.std = torch.tensor(std, dtype=torch.float32, device=device)
        self.fused = None
        if kernels == "triton":  # one Triton pass from the padded set: gather, crop, flip, normalize, cutout
            from fastcifar import kernels

            self.fused = kernels.module("augment").TritonAugment(augment, mean, std, dtype).to(device)
        self.shard_index, self.n_read = data_set_index(shard, len(images), index, n_read)  # epoch_plan's keys
        self._ahead = EpochAhead(self._device_plan)
        self.static: tuple[torch.Tensor, torch.Tensor] | None = None  # the step's buffers (bind_static)
        self.set_epoch(0, 0)

    def plain_images(self, n: int) -> torch.Tensor:
        """The shard's first ``n`` images un-augmented (the centre of the padded copy), normalized,
        fp32, NCHW-shaped: the data a data-dependent init (the whitening conv) reads."""
        pad = self.augment.crop_pad
        size = self.images.shape[1] - 2 * pad
        centre = self.images[:n, pad : pad + size, pad : pad + size]
        return normalize(centre, self.mean, self.std, torch.float32)

    def prepare(self, seeds: Streams | int, epoch: int) -> None:
        """Draw that epoch's plan now and start its copy to the device (``EpochAhead``)."""
        self._ahead.prepare(as_streams(seeds), epoch)

    def bind_static(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        """With the Triton augmentation: write each batch into the step's buffers and yield them, so
        the step copies nothing in (``run.graphs.StaticBatch.load``). Buffers of another batch size,
        dtype or layout are left unbound (the step copies). Each batch then overwrites the last:
        the training loop takes one at a time, in stream order."""
        if self.fused is None:
            return
        b = self.batch_size
        if (
            images.shape[0] == b
            and labels.shape == (b,)
            and images.dtype == self.dtype
            and labels.dtype == self.labels.dtype
            and images.device == labels.device == self.images.device
            and images.is_contiguous(memory_format=torch.channels_last)
        ):
            self.static = (images, labels)

    def _device_plan(self, streams: Streams, epoch: int) -> tuple[torch.Tensor, AugmentParams]:
        n = self.steps * self.batch_size
        order, plan = epoch_plan(
            streams, self.rank, epoch, n, self.augment, shard_index=self.shard_index, n_read=self.n_read
        )
        return plan_to_device(order, plan, self.device)

    def __iter__(self):
        b = self.batch_size
        order, plan = self._ahead.take(self.streams, self.epoch)
        for step in range(self.steps):
            idx = order[step * b : (step + 1) * b]
            params = plan.part(step * b, (step + 1) * b)
            if self.static is not None:  # written once, where the step reads it
                images, labels = self.static
                yield (
                    self.fused(self.images, params, index=idx, out=images),
                    torch.index_select(self.labels, 0, idx, out=labels),
                )
            elif self.fused is not None:
                yield self.fused(self.images, params, index=idx), self.labels[idx]
            else:
                images = augment_reference(self.images[idx], params, self.augment, self.mean, self.std, self.dtype)
                yield images, self.labels[idx]


class EmulatedRanks(TrainLoader):
    """``--emulate-ranks N``: the loaders of N ranks in one process, each step's batch their batches
    side by side (rank 0's images first). Each is the loader rank r would have under torchrun (its
    fixed shard, ``epoch_plan``'s order and augmentation draws for rank r), so one device
    sees exactly the images N ranks see, step by step; the network's batchnorm splits the batch
    back into the ranks' (``ops.norm_act_pool.PerRankStatistics``). The gradient of the batch's
    summed loss at the global batch is what N ranks' all-reduce averages, with the step rate the
    trainer already uses for one process at that batch (``run.recipe.peak_rate``: the rate per
    image of summed loss is ``lr x batch / 512 / batch`` here, N times that on a rank whose
    gradient is averaged over N: the same update). ``data.train_loader.make_train_loader`` builds it."""

    def __init__(self, loaders: list[TrainLoader]):
        if len({(loader.batch_size, len(loader)) for loader in loaders}) != 1:
            raise ValueError("emulated ranks need the same batch and steps on every rank")
        self.loaders = loaders
        self.batch_size, self.steps = loaders[0].batch_size * len(loaders), len(loaders[0])
        self.labels = torch.cat([loader.labels for loader in loaders])
        self.set_epoch(0, 0)

    def set_epoch(self, seeds: Streams | int, epoch: int) -> None:
        super().set_epoch(seeds, epoch)
        for loader in self.loaders:
            loader.set_epoch(seeds, epoch)

    def prepare(self, seeds: Streams | int, epoch: int) -> None:
        for loader in self.loaders:
            loader.prepare(seeds, epoch)

    def quiesce(self) -> None:
        for loader in self.loaders:
            loader.quiesce()

    def plain_images(self, n: int) -> torch.Tensor:
        """What N ranks' data-dependent init reads together: each rank's first ``ceil(n / N)``
        images (``run.whitening.Whitening.init_whitening`` gives each rank that share, and sums the
        ranks' patch covariances; here the covariance of their images together)."""
        share = -(-n // len(self.loaders))
        return torch.cat([loader.plain_images(share) for loader in self.loaders])

    def __iter__(self):
        for batches in zip(*self.loaders, strict=True):
            images, labels = zip(*batches, strict=True)
            yield torch.cat(images), torch.cat(labels)


class EvalSet:
    """The test images of one rank (every ``world_size``-th), normalized once, in fixed batches."""

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        batch_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        mean=CIFAR10_MEAN,
        std=CIFAR10_STD,
    ):
        mine = slice(rank, None, world_size)
        self.total = len(labels)  # images over all ranks
        self.images = normalize(torch.from_numpy(images[mine]).to(device), mean, std, dtype)
        self.labels = torch.from_numpy(labels[mine]).to(device)
        self.batch_size = batch_size

    def __len__(self) -> int:
        return -(-len(self.labels) // self.batch_size)

    @property
    def largest_batch(self) -> int:
        """Rows in this rank's largest batch: ``batch_size``, or all its images where they are fewer."""
        return min(self.batch_size, len(self.labels))

    def __iter__(self):
        for start in range(0, len(self.labels), self.batch_size):
            yield self.images[start : start + self.batch_size], self.labels[start : start + self.batch_size]
