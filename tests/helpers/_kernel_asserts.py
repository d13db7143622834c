"""Helpers shared by the kernel tests: where to run, poisoned allocation, comparison that says where.

Imported by tests/test_kernel_*.py (pytest puts tests/ on sys.path). Each test module sets
TRITON_INTERPRET=1 itself before importing triton when there is no GPU, so plain ``pytest`` on a
CPU-only CI machine runs the kernels under the interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# @triton.jit chooses interpreter or compiler when a function is defined, triton's own helpers
# included, so the variable must be set before anything imports triton. If something imported it
# earlier in this pytest process without the variable, the kernels cannot run on CPU tensors: say so
# and skip instead of failing with an obscure error deep inside Triton.
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1":
    from fastcifar.kernels.checks import interpreted

    if not interpreted():
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1 was set; run the kernel tests with "
            "TRITON_INTERPRET=1 in the environment or in their own pytest process",
            allow_module_level=True,
        )

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Interpreter or GPU: without either (TRITON_INTERPRET explicitly off on a CPU machine) skip cleanly.
needs_triton_backend = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="no CUDA device and TRITON_INTERPRET is not 1",
)


def poisoned_empty(orig):
    """Wrap a launcher's ``_empty``: float buffers come back NaN-filled, integer ones -1."""

    def empty(*args, **kwargs):
        t = orig(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        else:
            t.fill_(-1)
        return t

    return empty


def assert_close(got: torch.Tensor, ref: torch.Tensor, tol: float, what: str, rtol: float | None = None) -> None:
    """|got - ref| <= tol * max(1, max|ref|) + rtol * |ref| elementwise (rtol defaults to tol).

    NaN anywhere in ``got`` (an element the kernel never wrote) fails. The message names the worst
    element's index, both values, the difference and the number of elements out of tolerance.
    """
    got = got.detach().float().cpu()
    ref = ref.detach().float().cpu()
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    rtol = tol if rtol is None else rtol
    scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    atol = tol * scale
    err = (got - ref).abs()
    bad = ~(err <= atol + rtol * ref.abs())  # NaN compares False, so it counts as bad
    if bool(bad.any()):
        ranked = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
        i = int(torch.argmax(ranked))
        where = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), got.shape))
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{got.numel()} elements out of tolerance; worst at index {where}: "
            f"got {float(got.flatten()[i]):.6g}, reference {float(ref.flatten()[i]):.6g}, "
            f"|diff| {float(err.flatten()[i]):.3g} > {atol:.3g} + {rtol:.3g}*|ref|"
        )


def pool_windows(t: torch.Tensor) -> torch.Tensor:
    """(N, C, H//2, W//2, 4): each 2x2 max-pool window's values (floor mode), row-major in the window
    as the kernels' int8 argmax counts them."""
    n, c, h, w = t.shape
    ho, wo = h // 2, w // 2
    return t[:, :, : 2 * ho, : 2 * wo].reshape(n, c, ho, 2, wo, 2).permute(0, 1, 2, 4, 3, 5).reshape(n, c, ho, wo, 4)


def near_tie_windows(a: torch.Tensor, pre: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask over ``a`` (N, C, H, W): the elements of every 2x2 max-pool window whose two
    largest values are equal or at most one step of ``a``'s dtype apart, unless the largest is 0
    (the row/column a 2x2 pool drops is never marked). A window of ReLU zeros is a tie, but its
    gradient is 0 whichever element wins; marking those (about 8% of windows on random data) would
    exempt far more than the rare fused-multiply-add flips this is for. ``pre``: ``a``'s input to a
    ReLU, to mark also the windows whose largest input lies within the dtype's smallest normal
    number of 0 (``finfo.tiny``, 6.1e-5 in fp16), where the rounding of two O(1) fp32 terms that
    nearly cancel decides whether a ReLU passes the winner's gradient.

    Why: on a GPU ptxas contracts the kernel's ``x * scale + shift`` into one fused multiply-add
    (rounded once) where eager rounds the product and the sum apart, so now and then an fp32 value
    differs in its last bit; when that crosses an fp16 rounding boundary in a window whose top two
    are that close, the argmax moves, and a whole gradient moves with it in ``dx``: 5 of 33.5M
    elements at 512x256x16x16 fp16 (H100, 2026-11-22). A one-step exemption without the ReLU kink
    still left 3 of 33.5M elements failing on the H100 (second visit, same day), each with a whole
    gradient against the reference's 0.001; with the kink, one step is enough: every fp16 CUDA case
    that pools after passed (4 cases, third visit; the second visit had widened it to two steps
    together with the kink, untested apart). Either argmax is a correct subgradient, and the
    interpreter (numpy, no contraction) matches eager exactly, so only CUDA checks exempt them.
    """
    n, c, h, w = a.shape
    ho, wo = h // 2, w // 2
    top = pool_windows(a).float().topk(2, dim=-1).values
    finfo = torch.finfo(a.dtype)
    _, exponent = torch.frexp(top[..., 0])
    step = torch.clamp(
        torch.ldexp(torch.full_like(top[..., 0], finfo.eps), exponent - 1), min=finfo.tiny * finfo.eps
    )  # one unit in the last place of the largest
    near = ((top[..., 0] - top[..., 1]) <= step) & (top[..., 0] != 0)
    if pre is not None:
        near |= pool_windows(pre).float().amax(dim=-1).abs() <= finfo.tiny
    mask = torch.zeros(a.shape, dtype=torch.bool, device=a.device)
    mask[:, :, : 2 * ho, : 2 * wo] = (
        near[:, :, :, None, :, None].expand(n, c, ho, 2, wo, 2).reshape(n, c, 2 * ho, 2 * wo)
    )
    return mask
