"""The networks' building blocks, and which implementation of the normalize block they get.

The batchnorm/activation/pool trio is one module, ``NormActPool`` (``fastcifar.ops``), so that the
Triton kernel (``fastcifar.kernels.bn_act_pool.TritonNormActPool``, same constructor, same state)
can replace it without touching a network's definition: ``norm_blocks`` picks one for
``--kernels``, and every network takes it as its ``norm`` factory.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn

from fastcifar.core.config import CHOICES, ConfigError
from fastcifar.core.environment import ALLOW_INTERPRETER, interpreter_allowed
from fastcifar.ops.norm_act_pool import ConvBlock, NormActPool, NormFactory  # noqa: F401 (ConvBlock: the networks import it here)

KERNELS = CHOICES["kernels"]  # --kernels' choices: one list, in fastcifar.core.config


def resolve_kernels(requested: str, device: torch.device, fused_conv: bool = False) -> str:
    """``auto`` is Triton on CUDA, every block fused, and the torch reference on the CPU: on an H100
    the fused block beat cuDNN's batchnorm + activation (+ pool) on every preset block that eager
    could be timed on, pooled or not, and the graphed step was faster with every block fused
    (bench/results/visits/visit-5.md, 5b). Triton on the CPU runs in Triton's interpreter (correct, slow: for
    tests; see ``fastcifar.kernels.module``), which exists only in a process without a GPU: Triton chooses
    interpreter or compiler once per process, at import. It takes minutes per epoch, so it is refused
    unless the environment sets ``FASTCIFAR_ALLOW_INTERPRETER=1`` (the tests that train through it).
    ``fused_conv`` (--fused-conv): the conv kernel computes its block's normalize kernels too, so
    it needs the Triton path."""
    if requested not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, not {requested!r}")
    kernels = ("triton" if device.type == "cuda" else "torch") if requested == "auto" else requested
    if kernels == "triton" and device.type != "cuda" and torch.cuda.is_available():
        raise ConfigError(
            "--kernels triton on the CPU needs Triton's interpreter, which a machine with a GPU "
            "does not run (Triton compiles for the GPU there): use --kernels torch or --device cuda"
        )
    if kernels == "triton" and device.type != "cuda" and not interpreter_allowed():
        # refused, not run: it once ran silently, for minutes per epoch
        raise ConfigError(
            f"--kernels triton without a GPU runs Triton's interpreter, minutes per epoch (it is "
            f"there for tests): use --kernels torch, or set {ALLOW_INTERPRETER}=1 to run it anyway"
        )
    if kernels == "triton" and importlib.util.find_spec("triton") is None:
        # a CPU install leaves Triton out (pyproject's triton extra); torch's CUDA wheels bring it
        raise ConfigError(
            "--kernels triton needs the triton package, which this install leaves out: pip install -e "
            "'.[triton]' (torch's CUDA wheels on Linux bring it), or use --kernels torch"
        )
    if kernels == "triton" and importlib.util.find_spec("fastcifar.kernels") is None:
        # pyproject maps kernels/ into the package at install; a checkout's fastcifar/ found first
        # (python -m run in it beside a non-editable install, or no install at all) has none
        raise ConfigError(
            f"the Triton kernels (fastcifar.kernels) are not importable beside {Path(__file__).parents[1]}: "
            "a source checkout runs after `pip install -e .` in it (scripts/stage_tree.py lays out one "
            "that needs no install)"
        )
    if fused_conv and kernels != "triton":
        raise ConfigError(
            f"--fused-conv needs the Triton kernels; --kernels {requested} runs the torch ones on "
            f"{device.type} (use --kernels triton on a GPU)"
        )
    return kernels


def norm_factory(kernels: str) -> NormFactory:
    """The NormActPool implementation of a kernel path (``resolve_kernels``' answer)."""
    if kernels == "triton":
        from fastcifar import kernels

        return kernels.module("bn_act_pool").TritonNormActPool
    return NormActPool


def fuse_conv_blocks(model: nn.Module) -> int:
    """``--fused-conv``: every ConvBlock the fused conv kernel computes exactly (``conv_stats.fusable``:
    stride 1, "same", odd square kernel, the Triton normalize block) becomes its ``TritonConvBlock``,
    in place (same state, so optimizers, checkpoints and model files see the same tensors). Returns
    how many; the rest (AlexNet's strided first conv) keep cuDNN's conv."""
    from fastcifar import kernels

    conv_stats = kernels.module("conv_stats")
    fused = 0
    for m in model.modules():
        if conv_stats.fusable(m):
            m.__class__ = conv_stats.TritonConvBlock
            fused += 1
    return fused


def norm_blocks(requested: str, device: torch.device) -> NormFactory:
    """The NormActPool factory a network is built with for ``--kernels requested``: the fused
    Triton block for ``triton``, the plain-torch one for ``torch`` (``resolve_kernels``' answer)."""
    return norm_factory(resolve_kernels(requested, device))
