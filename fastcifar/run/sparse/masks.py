"""Which parameters train: top-K by score, random of the same size, or dealt out over ranks.

A mask is ``{parameter name: bool tensor of its shape}`` for the trainable parameters (frozen ones,
like a frozen whitening conv or frozen batchnorm scales, never train and are never in a mask).

The budget is ``fraction`` of all trainable parameters, rounded; it is spent on the highest scores
among the *scored* parameters. The classifier (the network's head, ``fc``) is always trainable, and so
are the batchnorm shifts when ``bn_shifts`` is set: these *forced* entries come on top of the budget
(ResNet-9's classifier is 5,120 of 6.57 M parameters, 0.08%; its shifts 2,240).

Disjoint layout over W ranks: the top ``W x budget`` scores are dealt out round-robin in order of
score (the best to rank 0, the next to rank 1, ...), so each rank trains a different ``budget``
entries; the forced entries are in every rank's mask.
"""

from __future__ import annotations

import torch
from torch import nn

from fastcifar.models.network import norm_layers


def forced_names(model: nn.Module, bn_shifts: bool) -> set[str]:
    """The always-trainable parameters of ``model`` (a ``models.network.Network``): the head's, and
    the batchnorm shifts if ``bn_shifts``."""
    by_id = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    forced = {by_id[id(p)] for p in model.fc.parameters() if id(p) in by_id}
    if bn_shifts:
        forced |= {by_id[id(m.bias)] for m in norm_layers(model) if id(m.bias) in by_id}
    return forced


def budget(scores: dict[str, torch.Tensor], fraction: float) -> int:
    return round(fraction * sum(s.numel() for s in scores.values()))


def _flat_scored(scores: dict[str, torch.Tensor], forced: set[str]):
    names = [n for n in scores if n not in forced]
    flat = torch.cat([scores[n].reshape(-1).float() for n in names]) if names else torch.zeros(0)
    return names, flat


def _unflatten(names, flat_mask, scores, forced) -> dict[str, torch.Tensor]:
    out, start = {}, 0
    for n in names:
        size = scores[n].numel()
        out[n] = flat_mask[start : start + size].view(scores[n].shape)
        start += size
    for n in forced:
        out[n] = torch.ones(scores[n].shape, dtype=torch.bool, device=scores[n].device)
    return {n: out[n] for n in scores}  # the scores' (registration) order


def top_k(scores: dict[str, torch.Tensor], fraction: float, forced: set[str]) -> dict[str, torch.Tensor]:
    """The ``budget`` highest scores among the non-forced parameters, plus the forced ones."""
    return deal(scores, fraction, forced, 1)[0]


def random_scores(like: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Uniform random scores: their top-K is a random mask of the same size (the baseline). The
    same seed gives the same mask on every rank and device."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.rand(t.shape, generator=g).to(t.device) for n, t in like.items()}


def deal(
    scores: dict[str, torch.Tensor], fraction: float, forced: set[str], world_size: int
) -> list[dict[str, torch.Tensor]]:
    """One mask per rank: the top ``world_size x budget`` scored entries dealt round-robin by rank
    in descending order of score, plus the forced entries in every mask."""
    names, flat = _flat_scored(scores, forced)
    k = min(world_size * budget(scores, fraction), flat.numel())
    order = torch.topk(flat, k, sorted=True).indices if k else flat.new_zeros(0, dtype=torch.long)
    masks = []
    for rank in range(world_size):
        mine = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
        mine[order[rank::world_size]] = True
        masks.append(_unflatten(names, mine, scores, forced))
    return masks


def count(mask: dict[str, torch.Tensor]) -> int:
    return int(sum(int(m.sum()) for m in mask.values()))


def describe(mask: dict[str, torch.Tensor], total: int) -> str:
    n = count(mask)
    return f"{n:,} of {total:,} parameters train ({100.0 * n / total:.2f}%)"
