"""The ``--arch`` network of a Config, built from a ``norm`` block factory (``NormActPool`` or its
Triton drop-in, ``blocks.norm_blocks``): batchnorm momentum and eps, frozen scales, a frozen
whitening conv. The trainer, the model files and the tests all build networks here."""

from __future__ import annotations

import functools

import torch
from torch import nn

from fastcifar.models import compiled
from fastcifar.models.alexnet import AlexNet
from fastcifar.models.blocks import fuse_conv_blocks, norm_factory, resolve_kernels
from fastcifar.models.fastnet import FastNet
from fastcifar.models.resnet9 import ResNet9
from fastcifar.ops.norm_act_pool import per_rank


def norm_layers(model: nn.Module) -> list[nn.Module]:
    """The batchnorm-like blocks: anything with running statistics and a scale/shift (NormActPool,
    its Triton drop-in, plain BatchNorm)."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "running_mean") and isinstance(getattr(m, "weight", None), nn.Parameter)
    ]


def make_network(cfg, norm, num_classes: int = 10) -> nn.Module:
    norm = functools.partial(norm, momentum=cfg.bn_momentum, eps=cfg.bn_eps)
    if cfg.arch == "resnet9":
        model = ResNet9(num_classes, widths=cfg.widths, norm=norm)
    elif cfg.arch == "alexnet":
        model = AlexNet(num_classes, widths=cfg.widths, norm=norm)
    elif cfg.arch == "fastnet":
        model = FastNet(
            num_classes,
            widths=cfg.widths,
            norm=norm,
            whiten_kernel=cfg.whiten_kernel,
            logit_scale=cfg.logit_scale or 1 / 9,
            head_unit_init=cfg.head_unit_init,
            act=cfg.activation,
        )
        model.whiten.weight.requires_grad_(not cfg.whiten_frozen)
    else:
        raise ValueError(f"unknown arch {cfg.arch!r}")
    if cfg.bn_scale_frozen:
        for m in norm_layers(model):
            m.weight.requires_grad_(False)  # stays at its init, 1: the next conv's scale absorbs it
    return model


def build_model(cfg, device: torch.device, dtype: torch.dtype, num_classes: int = 10) -> torch.nn.Module:
    """The network a run trains: ``--kernels``' normalize blocks (a custom op under --compile; with
    ``--emulate-ranks`` their statistics per emulated rank; with ``--fused-conv`` the conv kernel
    that takes their statistics), channels-last on ``device``, fp16 weights with fp32 batchnorm when
    ``dtype`` is fp16."""
    kernels = resolve_kernels(cfg.kernels, device, cfg.fused_conv)
    norm = compiled.norm_for(norm_factory(kernels), cfg.compile)  # custom op under --compile
    norm = per_rank(norm, cfg.emulate_ranks)  # --emulate-ranks: batchnorm statistics per emulated rank
    model = make_network(cfg, norm=norm, num_classes=num_classes)
    if cfg.fused_conv:
        fuse_conv_blocks(model)  # the conv kernel that takes its block's batchnorm statistics
    model = model.to(device=device, memory_format=torch.channels_last)
    if dtype == torch.float16:
        model.half()
        for m in model.modules():  # batchnorm keeps fp32 parameters and statistics
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.float()
    return model
