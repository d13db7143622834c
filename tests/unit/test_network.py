"""The networks' contract (models.network.Network) and the --arch table: every choice has a class,
every class builds itself from a Config and offers the trainer what the contract says."""

import dataclasses
import inspect

import pytest
import torch
from torch import nn

from fastcifar.core.config import CHOICES, from_preset
from fastcifar.models import network
from fastcifar.models.fastnet import FastNet
from fastcifar.models.network import NETWORKS, Network, WhiteningNetwork, keeps, make_network
from fastcifar.models.resnet9 import ResNet9
from fastcifar.ops.norm_act_pool import NormActPool

SMALL = {"resnet9": (8, 16, 32, 64), "fastnet": (8, 16, 16), "alexnet": (8, 16, 16, 16, 16)}
PRESET = {"resnet9": "resnet9", "fastnet": "fast", "alexnet": "alexnet"}


def small(arch: str, **overrides):
    return from_preset(PRESET[arch], widths=SMALL[arch], **overrides)


def test_the_table_covers_every_arch_choice():
    assert set(NETWORKS) == set(CHOICES["arch"]) == set(SMALL)


@pytest.mark.parametrize("arch", CHOICES["arch"])
def test_each_network_keeps_the_contract(arch):
    """Built from the table; forward on channels-last NCHW images gives (N, classes) logits; ``fc``
    is the linear head that makes them (a zero head gives zero logits); from_config is the class's
    own classmethod."""
    cls = NETWORKS[arch]
    assert isinstance(vars(cls).get("from_config"), classmethod), f"{cls.__name__} does not build itself from a Config"
    torch.manual_seed(0)
    model = make_network(small(arch), NormActPool, num_classes=7).to(memory_format=torch.channels_last).eval()
    assert type(model) is cls and keeps(model, Network)
    assert isinstance(model.fc, nn.Linear) and model.fc.out_features == 7
    images = torch.randn(3, 3, 32, 32).to(memory_format=torch.channels_last)
    logits = model(images)
    assert logits.shape == (3, 7) and logits.dtype == images.dtype and logits.abs().sum() > 0
    with torch.no_grad():
        for p in model.fc.parameters():
            p.zero_()
    assert torch.equal(model(images), torch.zeros(3, 7))


def test_make_network_picks_the_arch_from_the_table(monkeypatch):
    assert isinstance(make_network(small("fastnet"), NormActPool), FastNet)
    assert isinstance(make_network(small("resnet9"), NormActPool), ResNet9)

    class Toy(nn.Module):  # a new network: one class, one entry
        def __init__(self, width, num_classes, norm):
            super().__init__()
            self.norm = norm(width)
            self.fc = nn.Linear(3, num_classes)

        @classmethod
        def from_config(cls, cfg, norm, num_classes):
            return cls(cfg.widths[0], num_classes, norm)

        def forward(self, images):
            return self.fc(images.mean((2, 3)))

    monkeypatch.setitem(NETWORKS, "toy", Toy)
    cfg = dataclasses.replace(small("resnet9"), arch="toy", bn_momentum=0.3, bn_scale_frozen=True)
    toy = make_network(cfg, NormActPool, num_classes=4)
    assert isinstance(toy, Toy) and keeps(toy, Network) and toy.fc.out_features == 4
    # what every network gets alike: the batchnorm settings and the frozen scales
    assert toy.norm.momentum == 0.3 and not toy.norm.weight.requires_grad
    with pytest.raises(ValueError, match="unknown arch 'nothing'"):
        make_network(dataclasses.replace(cfg, arch="nothing"), NormActPool)


def test_fastnet_builds_its_whitening_conv_from_the_config():
    frozen = network.make_network(small("fastnet", whiten_frozen=True, whiten_kernel=3), NormActPool)
    assert frozen.whiten.kernel_size == (3, 3) and not frozen.whiten.weight.requires_grad
    trained = network.make_network(small("fastnet", whiten_frozen=False), NormActPool)
    assert trained.whiten.weight.requires_grad and trained.whiten.bias.requires_grad


def test_the_contract_check_sees_submodules_where_a_static_lookup_does_not():
    """``keeps`` looks members up as the trainer does. Python 3.12's ``isinstance`` against a
    runtime-checkable Protocol looks them up statically (``inspect.getattr_static``), which misses
    an nn.Module's submodules: FastNet's whitening would be skipped there (the GPU machine's Python)."""
    model = make_network(small("fastnet"), NormActPool)
    assert inspect.getattr_static(model, "whiten", None) is None  # what 3.12's isinstance would see
    assert keeps(model, WhiteningNetwork) and keeps(model, Network)
    model.whiten = nn.Linear(3, 3)  # the member there, of the wrong type: the contract is not kept
    assert not keeps(model, WhiteningNetwork) and keeps(model, Network)
    assert not keeps(nn.Linear(3, 3), Network)  # no fc, no from_config
