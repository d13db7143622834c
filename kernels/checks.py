"""Launcher checks shared by the kernels: device and the channels-last activation layout."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreted() -> bool:
    """Whether Triton's interpreter runs the kernels. Triton decided that when it was imported, so the
    answer is read from Triton itself, not from ``TRITON_INTERPRET`` now (``fastcifar.kernels.load``
    sets the variable for the import only)."""
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.zeros_like, InterpretedFunction)


def check_device(t: torch.Tensor, name: str) -> None:
    """A CUDA tensor, or any tensor when the Triton interpreter runs the kernels (CPU tests)."""
    if not t.is_cuda and not interpreted():
        raise ValueError(f"{name} is on {t.device}: Triton kernels need a CUDA tensor (or TRITON_INTERPRET=1)")


def check_activation(x: torch.Tensor, name: str = "x") -> None:
    """An NCHW-shaped, channels-last (NHWC in memory), fp16/bf16/fp32 tensor."""
    if x.dim() != 4:
        raise ValueError(f"{name} must be 4-D and NCHW-shaped, got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be one of {FLOAT_DTYPES}, got {x.dtype}")
    if not x.is_contiguous(memory_format=torch.channels_last):
        raise ValueError(
            f"{name} must be channels-last contiguous (NHWC in memory), got shape {tuple(x.shape)} with "
            f"strides {x.stride()}; make it once with .contiguous(memory_format=torch.channels_last) upstream"
        )
    check_device(x, name)
