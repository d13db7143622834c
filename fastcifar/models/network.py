"""The networks' contract with the trainer, the table of ``--arch`` choices, and the network of a
Config built for a run.

``Network`` is what every network offers the trainer; ``WhiteningNetwork`` is a network whose first
layer is a whitening conv set from the data (the run adds ``run.whitening.Whitening`` for it). A
network class builds itself from a Config (``from_config``: the ``norm`` block factory is
``NormActPool`` or its Triton drop-in, ``blocks.norm_blocks``) and has one entry in ``NETWORKS``;
``make_network`` adds what every network gets alike (batchnorm momentum and eps, frozen scales).
The trainer, the model files and the tests all build networks here. Whether a model keeps a
contract is ``keeps(model, contract)``, never ``isinstance``: from Python 3.12 ``isinstance``
against a runtime-checkable Protocol looks members up statically (``inspect.getattr_static``),
which cannot see an ``nn.Module``'s submodules (they live in its ``_modules``), so every network
would fail the check there and FastNet would train without its whitening."""

from __future__ import annotations

import functools
from typing import Protocol, get_type_hints

import torch
from torch import nn

from fastcifar.models import compiled
from fastcifar.models.alexnet import AlexNet
from fastcifar.models.blocks import NormFactory, fuse_conv_blocks, norm_factory, resolve_kernels
from fastcifar.models.fastnet import FastNet
from fastcifar.models.resnet9 import ResNet9
from fastcifar.ops.norm_act_pool import per_rank


class Network(Protocol):
    """What every network offers the trainer, besides being an ``nn.Module`` (parameters, state
    dict, train/eval, ``.to``):

    - ``forward(images)``: NCHW images (channels-last in memory on a run's device; 32x32, the
      normalized 3 channels) -> logits, (N, num_classes), in the images' dtype;
    - ``fc``: the head, the linear classifier that makes the logits; its weight is the optimizer's
      "head" group (``run.recipe.param_groups``, at ``--head-lr-scale``), its parameters stay
      trainable under every sparse mask (``run.sparse.masks.forced_names``). Its name is the
      model files' (``fc.weight``), so it stays;
    - ``from_config(cfg, norm, num_classes)``: the network of ``cfg`` (``cfg.widths`` and its own
      fields), with ``norm`` as every block's normalize block (momentum and eps already bound).
    """

    fc: nn.Linear

    @classmethod
    def from_config(cls, cfg, norm: NormFactory, num_classes: int) -> Network: ...

    def forward(self, images: torch.Tensor) -> torch.Tensor: ...


class WhiteningNetwork(Network, Protocol):
    """A network whose first layer, ``whiten``, is a conv whose weights are set from training
    images at the start of training (``models.fastnet.init_whitening``) and whose bias trains for
    the first ``--whiten-bias-epochs`` only: ``run.whitening.Whitening`` does both. With
    ``--whiten-frozen`` (the network's ``from_config`` reads it) its weights take no step."""

    whiten: nn.Conv2d


def keeps(model: object, contract: type) -> bool:
    """Whether ``model`` has every member the Protocol ``contract`` names, looked up as the trainer
    uses them (``getattr``): each annotated attribute an instance of its type, each method callable."""
    for klass in contract.__mro__:
        if not getattr(klass, "_is_protocol", False) or klass is Protocol:
            continue
        for name, kind in get_type_hints(klass).items():
            if not isinstance(getattr(model, name, None), kind):
                return False
        for name, member in vars(klass).items():
            if not name.startswith("_") and callable(getattr(member, "__func__", member)):
                if not callable(getattr(model, name, None)):
                    return False
    return True


# --arch -> the network's class: a new network is its class (the contract above) and one entry
NETWORKS: dict[str, type[Network]] = {"resnet9": ResNet9, "fastnet": FastNet, "alexnet": AlexNet}


def norm_layers(model: nn.Module) -> list[nn.Module]:
    """The batchnorm-like blocks: anything with running statistics and a scale/shift (NormActPool,
    its Triton drop-in, plain BatchNorm)."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "running_mean") and isinstance(getattr(m, "weight", None), nn.Parameter)
    ]


def make_network(cfg, norm, num_classes: int = 10) -> nn.Module:
    """The ``--arch`` network of ``cfg`` (``NETWORKS``), its blocks' batchnorm at ``--bn-momentum``
    and ``--bn-eps``, their scales frozen with ``--bn-scale-frozen``."""
    if cfg.arch not in NETWORKS:
        raise ValueError(f"unknown arch {cfg.arch!r}")
    norm = functools.partial(norm, momentum=cfg.bn_momentum, eps=cfg.bn_eps)
    model = NETWORKS[cfg.arch].from_config(cfg, norm, num_classes)
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
