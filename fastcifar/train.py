"""fastcifar.train: train a ResNet on CIFAR-10 on one device or data-parallel under torchrun.

    python -m fastcifar.train --data data --download              # one GPU (or CPU)
    torchrun --nproc_per_node 8 -m fastcifar.train --data data    # 8 GPUs, one machine

Current result: not yet measured on a GPU. The seed recipe (preset ``resnet9``) is the plain-PyTorch
reference path; no GPU was available when it was written (2026-11-22), so no time or accuracy is
claimed here yet. Figures land in ``bench/results/`` with device, versions and date.

The story of one invocation: join the ranks, load the data, then for each run build the model and
optimizer, take a few untimed warm-up steps and restore the initial state, train epoch by epoch
with the clock stopped during evaluation, and report.
"""

from __future__ import annotations

import copy
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from . import comm, distributed
from .config import Config, ConfigError, parse_args, validate
from .data import DataError, load_dataset, shard_indices
from .loader import EvalSet, TorchLoader
from .model import NormActPool, ResNet9
from .optim import NesterovSGD, warmup_decay_lr
from .report import EpochRecord, RunLog, RunResult, device_info, process_start_time, versions

PROCESS_START = process_start_time()


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    ctx = None
    try:
        ctx = distributed.setup(cfg.device, cfg.dist_timeout_s)
        # Before validate: ranks launched with different settings all stop here, none validates alone.
        distributed.check_same(distributed.config_digest(cfg), "config", ctx)
        validate(cfg, ctx.world_size)
        train(cfg, ctx)
        return 0
    except (ConfigError, DataError) as exc:
        where = f"[rank {ctx.rank}] " if ctx is not None and ctx.distributed else ""
        print(f"fastcifar: error: {where}{exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        if not distributed.is_comm_failure(exc):
            raise
        # Another rank died or stalled. No teardown: a broken group can block in it; exiting frees it.
        print(f"fastcifar: error: [rank {os.environ.get('RANK', '0')}] "
              f"{distributed.failure_message(exc, cfg.dist_timeout_s)}", file=sys.stderr)
        ctx = None
        return 3
    finally:
        if ctx is not None:
            distributed.teardown(ctx)


def train(cfg: Config, ctx: distributed.DistContext) -> list[RunResult]:
    log = RunLog(cfg, cfg.out_dir, enabled=ctx.is_main)
    half = cfg.precision == "fp16" or (cfg.precision == "auto" and ctx.device.type == "cuda")
    dtype = torch.float16 if half else torch.float32
    if ctx.device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed shapes: pick the fastest conv algorithm once

    # Data: every rank reads the set, keeps its fixed shard on the device, and the same number of steps.
    data = load_dataset(cfg.data, cfg.download, cfg.cache_dir or None, log=log.line).subset(cfg.subset)
    per_rank_batch = cfg.batch_size // ctx.world_size
    steps = len(data.train_labels) // ctx.world_size // per_rank_batch
    if steps == 0:
        raise ConfigError(f"--batch-size {cfg.batch_size} is larger than the training set "
                          f"({len(data.train_labels)} images over {ctx.world_size} ranks)")
    shard = shard_indices(len(data.train_labels), ctx.rank, ctx.world_size)
    train_loader = TorchLoader(data.train_images, data.train_labels, shard, per_rank_batch, steps,
                               pad=cfg.crop_pad, pad_mode=cfg.pad_mode, cutout=cfg.cutout, flip=cfg.flip,
                               dtype=dtype, device=ctx.device, rank=ctx.rank)
    test_set = EvalSet(data.test_images, data.test_labels, cfg.eval_batch_size, dtype=dtype,
                       device=ctx.device, rank=ctx.rank, world_size=ctx.world_size)
    log.start({"versions": versions(), "device": device_info(ctx.device, ctx.world_size),
               "data": f"{data.source}: {len(data.train_labels)} train, {len(data.test_labels)} test images",
               "steps_per_epoch": steps, "per_rank_batch": per_rank_batch})

    results = []
    for run in range(1, cfg.runs + 1):
        results.append(train_one_run(cfg, ctx, run, cfg.seed + run - 1, dtype, train_loader, test_set, log))
        log.run_done(results[-1], cfg.target_acc)
    log.finish(results)
    return results


def build_model(cfg: Config, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    model = ResNet9(widths=cfg.widths, norm=NormActPool)
    model = model.to(device=device, memory_format=torch.channels_last)
    if dtype == torch.float16:
        model.half()
        for m in model.modules():  # batchnorm keeps fp32 parameters and statistics
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.float()
    return model


def train_one_run(cfg, ctx, run, seed, dtype, train_loader, test_set, log) -> RunResult:
    torch.manual_seed(seed)  # same seed on every rank: identical initial weights
    model = build_model(cfg, ctx.device, dtype)
    distributed.check_same(distributed.model_digest(model), "model's parameter shapes", ctx)
    net, buckets = model, None
    if ctx.distributed and cfg.comm == "ddp":
        net = DistributedDataParallel(model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
                                      broadcast_buffers=False)
    elif ctx.distributed:  # gradients become views into flat buckets, all-reduced during backward
        buckets = comm.GradBuckets(model.parameters(), cfg.bucket_mb)
        if run == 1:
            log.line(buckets.describe())
    # Loss summed over the rank's batch, so the step is divided by the per-rank batch (see config.py).
    per_rank_batch = train_loader.batch_size
    peak = cfg.lr * cfg.batch_size / 512 / per_rank_batch
    opt = NesterovSGD(model.parameters(), lr=0.0, momentum=cfg.momentum,
                      weight_decay=cfg.weight_decay * per_rank_batch, nesterov=cfg.nesterov)
    steps = len(train_loader)

    def step(images, labels, lr):
        opt.set_lr(lr)
        logits = net(images)
        loss = F.cross_entropy(logits.float(), labels, reduction="sum", label_smoothing=cfg.label_smoothing)
        loss.backward()
        if buckets is not None:
            buckets.finish()  # the optimizer waits for every bucket's average
        opt.step()
        opt.zero_grad()  # in place, so bucketed gradients stay views into their buckets
        return loss.detach(), (logits.argmax(1) == labels).sum()

    # Warm-up: cuDNN's algorithm search and the allocator's first allocations stay off the clock;
    # weights, batchnorm statistics and momentum are then put back to the initial state.
    if cfg.warmup_steps:
        initial = copy.deepcopy(model.state_dict())
        train_loader.set_epoch(seed, 10**6)  # an epoch index training never uses
        model.train()
        for i, (images, labels) in zip(range(cfg.warmup_steps), train_loader):
            step(images, labels, 0.0)
        model.load_state_dict(initial)
        opt.reset_state()

    total_train_time = 0.0
    result = RunResult(run=run, seed=seed, test_acc=0.0, train_time=0.0, wall_time=0.0)
    for epoch in range(cfg.epochs):
        train_loader.set_epoch(seed, epoch)
        model.train()
        loss_sum = torch.zeros((), device=ctx.device)
        correct = torch.zeros((), dtype=torch.int64, device=ctx.device)
        synchronize(ctx.device)
        t0 = time.perf_counter()
        for i, (images, labels) in enumerate(train_loader):
            lr = warmup_decay_lr(epoch + (i + 1) / steps, cfg.epochs, cfg.warmup_epochs, peak)
            loss, hits = step(images, labels, lr)
            loss_sum += loss
            correct += hits
        synchronize(ctx.device)
        epoch_time = time.perf_counter() - t0
        total_train_time += epoch_time

        t1 = time.perf_counter()
        distributed.average_buffers(model, ctx)
        test_loss, test_acc = evaluate(model, test_set, cfg.tta, ctx)
        n_train = steps * per_rank_batch
        train_loss, train_correct = distributed.all_sum([loss_sum.item(), float(correct.item())], ctx, ctx.device)
        record = EpochRecord(run=run, epoch=epoch + 1, lr=lr * per_rank_batch, train_time=epoch_time,
                             train_loss=train_loss / (n_train * ctx.world_size),
                             train_acc=100.0 * train_correct / (n_train * ctx.world_size),
                             test_time=time.perf_counter() - t1, test_loss=test_loss, test_acc=test_acc,
                             total_train_time=total_train_time)
        result.epochs.append(record)
        log.epoch(record)
    result.test_acc = result.epochs[-1].test_acc
    result.train_time = total_train_time
    result.wall_time = time.time() - PROCESS_START
    return result


@torch.no_grad()
def evaluate(model, test_set: EvalSet, tta: bool, ctx) -> tuple[float, float]:
    """Test loss and accuracy (%) over all ranks' slices; with ``tta`` the logits of each image
    and its mirror image are summed."""
    model.eval()
    loss = torch.zeros((), device=ctx.device)
    correct = torch.zeros((), dtype=torch.int64, device=ctx.device)
    for images, labels in test_set:
        logits = model(images).float()
        if tta:
            logits = 0.5 * (logits + model(images.flip(3)).float())
        loss += F.cross_entropy(logits, labels, reduction="sum")
        correct += (logits.argmax(1) == labels).sum()
    total_loss, total_correct, count = distributed.all_sum(
        [loss.item(), float(correct.item()), float(len(test_set.labels))], ctx, ctx.device)
    return total_loss / count, 100.0 * total_correct / count


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    sys.exit(main())
