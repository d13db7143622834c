"""``SparseRun``: the sparse-training calls of one run of the trainer (see the package docstring).

Its own module, not the package's ``__init__``, so ``python -m fastcifar.run.sparse.diffs`` does not
import itself twice."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fastcifar.models.files import write_atomic
from fastcifar.ops.augment import CIFAR10_MEAN, CIFAR10_STD
from fastcifar.parallel.local_sgd import LocalSGD
from fastcifar.run.component import Component
from fastcifar.run.sparse import fisher, masks
from fastcifar.run.sparse.diffs import DiffWriter
from fastcifar.run.sparse.update import MaskedOptimizer


class SparseRun(Component):
    def __init__(self, cfg, model: torch.nn.Module, opt, train_loader, ctx, log, run: int, seed: int):
        self.cfg, self.model, self.loader, self.ctx, self.log = cfg, model, train_loader, ctx, log
        self.run, self.seed = run, seed
        self.params = fisher.trainable(model)
        self.total = sum(p.numel() for p in self.params.values())
        self.masked = cfg.sparse_mask != "none"
        self.optimizer = MaskedOptimizer(opt, self.params, cfg.sparse_update) if self.masked else opt
        self.forced = masks.forced_names(model, cfg.mask_bn_shifts)
        self.local = None
        if cfg.local_steps and ctx.distributed:
            self.local = LocalSGD(
                self.params,
                list(model.buffers()),
                self.optimizer,
                cfg.local_steps,
                cfg.merge,
                cfg.local_momentum,
                ctx.world_size,
                ctx.rank,
            )
        self.diffs = None
        if cfg.sparse_checkpoints and ctx.is_main and log.dir is not None:
            self.diffs = DiffWriter(
                Path(log.dir) / "sparse" / f"run{run}",
                model,
                cfg,
                log.meta.get("classes", []),
                CIFAR10_MEAN,
                CIFAR10_STD,
            )
        self.record: dict = {
            "run": run,
            "mask": cfg.sparse_mask,
            "fraction": cfg.sparse_fraction,
            "trainable": self.total,
            "masks": [],
            "diffs": [],
            "local_sgd": None,
        }

    # --- the trainer's calls ---------------------------------------------------------------

    def epoch_start(self, epoch: int) -> None:
        every = self.cfg.mask_every
        if self.masked and (epoch == 0 or (every and epoch % every == 0)):
            self.choose_masks(epoch)
        if epoch == 0 and self.local is not None:
            self.local.rebase()  # after the whitening init, which every rank made alike
            self.log.line(self.local.describe())  # once per run: the figures are fixed by the masks
            self.record["local_sgd"] = {"every": self.cfg.local_steps, **self.local.bytes_per_merge()}
        if epoch == 0 and self.diffs is not None:
            self.diffs.start()  # after the data-dependent inits: the base the first diff is taken against

    def after_step(self) -> None:
        if self.local is not None:
            self.local.after_step()

    def epoch_end(self, epoch: int) -> None:
        if self.local is not None:
            self.local.epoch_end()

    def epoch_done(self, epoch: int, record) -> None:
        if self.diffs is not None:
            self.log.line(self.diffs.epoch(epoch + 1, record.test_acc))

    def finish(self, result=None) -> None:
        if self.local is not None:
            self.record["local_sgd"]["merges"] = self.local.merges
        if self.diffs is not None:
            self.record["diffs"] = self.diffs.records
        if self.log.dir is not None and (self.masked or self.local or self.diffs):
            # atomic, and a full disk is one line (CheckpointError), exit 2, as for the model file
            write_atomic(Path(self.log.dir) / f"sparse-run{self.run}.json", json.dumps(self.record, indent=1))

    # --- masks -----------------------------------------------------------------------------

    def choose_masks(self, epoch: int) -> None:
        cfg, ctx = self.cfg, self.ctx
        if cfg.sparse_mask == "fisher":
            n = fisher.per_rank_samples(cfg.mask_samples, ctx.world_size, len(self.loader.labels))
            images = self.loader.plain_images(n)
            labels = self.loader.labels[:n]
            reduce = None
            if ctx.distributed:
                import torch.distributed as dist

                reduce = dist.all_reduce
            scores = fisher.fisher_for_mask(self.model, images, labels, cfg.mask_score, reduce=reduce)
            if ctx.distributed:  # the same bits everywhere, whatever the all-reduce's rounding per rank
                for s in scores.values():
                    torch.distributed.broadcast(s, src=0)
        else:
            scores = masks.random_scores({k: p.detach() for k, p in self.params.items()}, self.seed * 1000 + epoch)
        disjoint = cfg.mask_layout == "disjoint" and self.local is not None
        dealt = masks.deal(scores, cfg.sparse_fraction, self.forced, ctx.world_size if disjoint else 1)
        mine = dealt[ctx.rank] if disjoint else dealt[0]
        self.optimizer.set_masks(mine)
        if self.local is not None:
            self.local.set_masks(dealt, shared=self.forced)
            if epoch > 0 and cfg.sparse_update == "grad" and cfg.local_momentum == "keep":
                # grad mode moves entries outside the mask too (decay, momentum), and the merges now
                # cover only the new masks (every rank's, in the disjoint layout): an entry outside them
                # would go on with this rank's own momentum, never merged again. The weights are equal
                # on every rank here (just after the epoch-end merge), so equal momentum keeps every
                # such entry equal. Merged entries keep their own: averaging them too would shrink an
                # owner's momentum ~world_size-fold (the others' is decay only) at every mask change.
                # (--local-momentum reset: the merge just zeroed it all, nothing to average.)
                covered = {n: torch.stack([d[n] for d in dealt]).any(0) for n in dealt[0]}
                self.optimizer.average_momentum_outside(covered, ctx.world_size)
        line = f"mask ({cfg.sparse_mask}, epoch {epoch}): {masks.describe(mine, self.total)}"
        if disjoint:
            line += f" on each of {ctx.world_size} ranks, disjoint but for the classifier/BN shifts"
        self.log.line(line)
        self.record["masks"].append({"epoch": epoch, "count": masks.count(mine)})
