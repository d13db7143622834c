"""Fisher information of each parameter, from per-sample gradients (``torch.func``: vmap of grad).

The score of a parameter is a sum over N training samples of its per-sample gradient of the
log-likelihood loss (cross-entropy, no label smoothing: the Fisher is of the model's likelihood):

    squared   sum_i g_i(y_i)^2                 (the empirical Fisher's diagonal, the default)
    abs       sum_i |g_i(y_i)|
    expected  sum_i sum_c p(c | x_i) g_i(c)^2  (the true Fisher's diagonal: labels drawn from the
                                                model, the expectation taken exactly over the classes)

A per-sample gradient is only defined when a sample's output does not depend on the other samples
in its batch, so batchnorm runs on running statistics here (eval mode). ``fisher_for_mask``
first refreshes those statistics on the same N samples in a copy of the model, so a model fresh
from its init (running mean 0, variance 1) is scored as it behaves when training, and the
training model and its statistics are left untouched.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from fastcifar.core.config import CHOICES
from fastcifar.ops.norm_act_pool import as_plain_torch


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def _accumulate(scores: dict, grads: dict, variant: str, weight: torch.Tensor | None = None) -> None:
    for name, g in grads.items():  # g: (chunk, *param shape)
        term = g.abs() if variant == "abs" else g.square()
        if weight is not None:
            term = term * weight.view(-1, *([1] * (term.dim() - 1)))
        scores[name] += term.sum(0)


def fisher_scores(
    model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, variant: str = "squared", chunk: int = 64
) -> dict[str, torch.Tensor]:
    """Scores (fp32, each parameter's shape) of the trainable parameters over ``images``/``labels``.
    The model is used as it is (put it in eval mode first); ``chunk`` samples' gradients are held
    at once (memory: chunk x the parameters)."""
    if variant not in CHOICES["mask_score"]:
        raise ValueError(f"fisher variant must be one of {CHOICES['mask_score']}, not {variant!r}")
    params = {n: p.detach() for n, p in trainable(model).items()}
    others = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())

    def loss(ps, x, y):
        logits = functional_call(model, (ps, others, buffers), (x.unsqueeze(0),))
        return F.cross_entropy(logits.float(), y.unsqueeze(0))

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))
    scores = {n: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for n, p in params.items()}
    for start in range(0, len(labels), chunk):
        x, y = images[start : start + chunk], labels[start : start + chunk]
        if variant != "expected":
            _accumulate(scores, per_sample(params, x, y), variant)
            continue
        with torch.no_grad():
            probs = functional_call(model, (params, others, buffers), (x,)).float().softmax(1)
        for c in range(probs.shape[1]):  # one gradient pass per class, weighted by the model's belief
            _accumulate(scores, per_sample(params, x, torch.full_like(y, c)), "squared", probs[:, c])
    return scores


def scoring_copy(model: torch.nn.Module, images: torch.Tensor, chunk: int = 256) -> torch.nn.Module:
    """An fp32 copy of ``model`` in eval mode whose batchnorm statistics are the average of the
    batch statistics of ``images`` in chunks of ``chunk`` (a cumulative average: chunk i enters with
    weight 1/(i+1)); Triton norm blocks become their plain-torch parent (same state, same maths; a
    Triton kernel cannot be vmapped)."""
    scorer = as_plain_torch(copy.deepcopy(model).float())
    for m in scorer.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
    norms = [m for m in scorer.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    scorer.train()
    with torch.no_grad():
        for i, start in enumerate(range(0, len(images), chunk)):
            for m in norms:
                m.momentum = 1.0 / (i + 1)
            scorer(images[start : start + chunk].float())
    return scorer.eval()


def fisher_for_mask(
    model: torch.nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    variant: str = "squared",
    chunk: int = 64,
    reduce=None,
) -> dict[str, torch.Tensor]:
    """Scores of ``model``'s trainable parameters for choosing a mask. ``reduce`` (an all-reduce,
    several ranks) sums the ranks' scores, each from its own shard's samples."""
    scorer = scoring_copy(model, images)
    scores = fisher_scores(scorer, images.float(), labels, variant, chunk)
    if reduce is not None:
        for s in scores.values():
            reduce(s)
    return scores


def per_rank_samples(total: int, world_size: int, available: int) -> int:
    return min(available, math.ceil(total / world_size))
