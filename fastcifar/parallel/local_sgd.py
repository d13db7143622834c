"""Local SGD over ranks: each rank trains on its own shard, and every H steps the ranks merge.

No gradient is all-reduced per step (the trainer builds no buckets and no DDP under
``--local-steps``); instead, after every H-th step (outside any CUDA graph: the merge is eager
collectives on the host's schedule) and at each epoch's end (so every rank evaluates the same
weights), ``merge`` combines each rank's change since the last merge:

    new = anchor + combine_r(p_r - anchor)       combine = mean or sum over ranks

- dense (``masks`` None): every trainable entry, all-reduced;
- shared mask: the entries of the one mask, all-reduced (values only: the mask is the same on
  every rank, so no index is sent);
- disjoint masks: each rank's dealt entries belong to it alone and are all-gathered (each rank
  sends its own values, padded to the largest rank's count); an owned entry takes its owner's
  change (mean and sum agree: one rank changed it); the forced entries (classifier, batchnorm
  shifts), in every rank's mask, are all-reduced as in the shared layout.

Every rank applies the same arithmetic to the same gathered numbers, so the ranks hold identical
weights after a merge. Batchnorm running statistics (every floating-point buffer) are averaged at
each merge. Local momentum is kept, or zeroed after each merge (``reset``).

Bytes per merge are what one rank hands to its collectives (the payload; a ring all-reduce moves
about 2(W-1)/W times that over each link): values in the parameters' dtypes, plus the buffers.
The dense data-parallel figure beside it is the gradient all-reduce's payload per step: every
trainable parameter, once.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from fastcifar.core.config import CHOICES
from fastcifar.parallel import distributed


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of ``t`` in memory order (channels-last weights included): in-place writes land."""
    dims = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return t.permute(dims).view(-1)


def _count(flat: torch.Tensor, idx: torch.Tensor | None) -> int:
    return flat.numel() if idx is None else idx.numel()


def memory_indices(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    laid_out = torch.zeros_like(like, dtype=torch.bool).copy_(mask.to(like.device))
    return flat_view(laid_out).nonzero().squeeze(1)


class LocalSGD:
    def __init__(
        self,
        named_params: dict[str, torch.Tensor],
        buffers: list[torch.Tensor],
        opt,
        every: int,
        merge: str = "mean",
        momentum: str = "keep",
        world_size: int = 1,
        rank: int = 0,
    ):
        if every <= 0:
            raise ValueError(f"local SGD merges every H >= 1 steps, not {every}")
        if merge not in CHOICES["merge"] or momentum not in CHOICES["local_momentum"]:
            raise ValueError(f"merge must be one of {CHOICES['merge']} and momentum one of {CHOICES['local_momentum']}")
        self.params, self.opt, self.every = named_params, opt, every
        self.merge_op, self.momentum, self.world, self.rank = merge, momentum, world_size, rank
        self.buffers = [b for b in buffers if b.is_floating_point()]
        self.steps = 0  # local steps since the last merge
        self.merges = 0
        self.set_masks(None)

    def set_masks(self, rank_masks: list[dict[str, torch.Tensor]] | None, shared: set[str] | None = None) -> None:
        """``None``: dense. One mask: the shared layout. One per rank: disjoint, where ``shared``
        names the parameters every rank trains (the forced ones), all-reduced."""
        # Per dtype: [(param flat view, reduced idx, [owned idx per rank])]; idx None: the whole
        # tensor (dense: no index of 8 bytes per entry to store and gather through)
        plan = defaultdict(list)
        self.owned = rank_masks is not None and len(rank_masks) > 1
        for name, p in self.params.items():
            flat = flat_view(p.data)
            none = flat.new_zeros(0, dtype=torch.long, device=p.device)
            owned = [none] * self.world if self.owned else []
            if rank_masks is None:
                reduced = None
            elif not self.owned or name in (shared or set()):
                reduced = memory_indices(rank_masks[0][name], p)
            else:
                reduced, owned = none, [memory_indices(m[name], p) for m in rank_masks]
            plan[p.dtype].append((flat, reduced, owned))
        self.plan = dict(plan)
        self.rebase()

    def rebase(self) -> None:
        """Take the current weights as the anchor: after a change every rank made identically
        (the data-dependent init at epoch 0), which a sum merge would otherwise count W times."""
        self.anchor = {dt: self._gather_values(dt) for dt in self.plan}

    def _gather_values(self, dtype, owners=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The reduced entries' values, and the owned entries' values of each rank in ``owners``
        (default: every rank, as the anchor needs; a merge sends only this rank's own)."""
        entries = self.plan[dtype]
        reduced = torch.cat([flat if r is None else flat[r] for flat, r, _ in entries])
        owners = range(self.world) if owners is None else owners
        owned = [torch.cat([flat[o[k]] for flat, _, o in entries]) for k in owners] if self.owned else []
        return reduced, owned

    def bytes_per_merge(self) -> dict[str, int]:
        values = 0
        for dtype, entries in self.plan.items():
            size = torch.empty((), dtype=dtype).element_size()
            values += size * sum(_count(flat, r) for flat, r, _ in entries)
            if self.owned:
                values += size * max(sum(o[k].numel() for _, _, o in entries) for k in range(self.world))
        buffers = sum(b.numel() * b.element_size() for b in self.buffers)
        dense = sum(p.numel() * p.element_size() for p in self.params.values())
        return {"values": values, "buffers": buffers, "per_merge": values + buffers, "dense_allreduce": dense}

    def describe(self) -> str:
        b = self.bytes_per_merge()
        return (
            f"local SGD: merge every {self.every} steps ({self.merge_op}, momentum {self.momentum}) sends "
            f"{b['per_merge']:,} bytes per rank ({b['values']:,} values + {b['buffers']:,} BN buffers); "
            f"dense data parallel all-reduces {b['dense_allreduce']:,} bytes of gradients every step"
        )

    def after_step(self) -> None:
        self.steps += 1
        if self.steps == self.every:
            self.merge()

    def epoch_end(self) -> None:
        """Merge unless the last step just did: every rank evaluates (and checkpoints) the same weights."""
        if self.steps:
            self.merge()

    @torch.no_grad()
    def merge(self) -> None:
        if self.world > 1:
            merged = {}
            for dtype in self.plan:
                anchor_r, anchor_o = self.anchor[dtype]
                now_r, now_o = self._gather_values(dtype, owners=[self.rank])
                delta = now_r - anchor_r
                dist.all_reduce(delta)
                if self.merge_op == "mean":
                    delta /= self.world
                new_r = anchor_r + delta
                new_o = []
                if self.owned:
                    counts = [a.numel() for a in anchor_o]
                    mine = torch.zeros(max(counts), dtype=dtype, device=delta.device)
                    mine[: counts[self.rank]] = now_o[0] - anchor_o[self.rank]
                    gathered = [torch.empty_like(mine) for _ in range(self.world)]
                    dist.all_gather(gathered, mine)
                    new_o = [anchor_o[k] + gathered[k][: counts[k]] for k in range(self.world)]
                self._scatter(dtype, new_r, new_o)
                merged[dtype] = (new_r, new_o)
            distributed.average_buffers(self.buffers, self.world)
            self.anchor = merged  # what _scatter just wrote: no gather needed to read it back
        if self.momentum == "reset":
            self.opt.reset_state()
        self.merges += 1
        self.steps = 0  # steps since this merge: an epoch-end merge restarts the count of H

    def _scatter(self, dtype, new_r: torch.Tensor, new_o: list[torch.Tensor]) -> None:
        start_r, start_o = 0, [0] * len(new_o)
        for flat, r, o in self.plan[dtype]:
            n = _count(flat, r)
            if r is None:
                flat.copy_(new_r[start_r : start_r + n])
            else:
                flat[r] = new_r[start_r : start_r + n]
            start_r += n
            for k, idx in enumerate(o):
                flat[idx] = new_o[k][start_o[k] : start_o[k] + idx.numel()]
                start_o[k] += idx.numel()
