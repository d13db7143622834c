"""The Python API: ``import fastcifar`` and train, load, evaluate and predict from a notebook.

    import fastcifar
    cfg = fastcifar.from_preset("fast", data="data", epochs=2)
    (run,) = fastcifar.train(cfg)                  # validated exactly as the command line validates
    run.model, run.test_acc, run.metrics.epochs    # the trained network in memory, and its records
    run.outputs.test_margins                       # save_outputs="test": per-example arrays (numpy)
    model, info = fastcifar.load_model(run.model_path)
    fastcifar.evaluate((model, info), "data").accuracy
    fastcifar.predict(run.model_path, ["cat.png"])

The modules ``train``, ``evaluate`` and ``predict`` are themselves callable (``fastcifar.cli``
says why), so ``fastcifar.train(cfg)`` is this module's ``train`` whether or not something
imported ``fastcifar.train`` first.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from fastcifar.core.config import Config, ConfigError
from fastcifar.data import DataError
from fastcifar.models.files import ModelInfo, load_model
from fastcifar.ops.norm_act_pool import as_plain_torch
from fastcifar.run.report import RunResult


@dataclass
class TrainedRun:
    """One run of ``train``: the trained network (in memory, on the run's device, evaluated
    weights), what describes it, and its metrics (per-epoch records, times)."""

    model: torch.nn.Module
    info: ModelInfo
    metrics: RunResult

    @property
    def test_acc(self) -> float:
        return self.metrics.test_acc

    @property
    def model_path(self) -> str:
        return self.metrics.model_path

    @property
    def outputs(self):
        """``--save-outputs``' arrays (``run.outputs.PerExample``: test_logits, test_margins,
        train_logits, train_margins, None where not asked for), from memory; None without it."""
        return self.metrics.outputs


def train(config: Config, reuse=None) -> list[TrainedRun]:
    """Train ``config.runs`` runs as ``python -m fastcifar.train`` would with these settings
    (the same validation, logs and run folder); raises ConfigError or DataError on bad input.
    Under torchrun every rank calls it and gets its own copy of the results. ``reuse``: a
    ``fastcifar.run.engine.Reuse`` the caller keeps between calls (the sweep worker's): a later
    call on the same data settings reads no data, and its runs train on an engine an earlier call
    built when their settings differ only in per-run fields (seeds, subset, outputs, run folder)."""
    from fastcifar import train as trainer
    from fastcifar.ops.augment import CIFAR10_MEAN, CIFAR10_STD
    from fastcifar.parallel import distributed

    if not isinstance(config, Config):
        raise ConfigError(f"train() takes a fastcifar.Config, not {type(config).__name__}")
    from fastcifar.core import signals
    from fastcifar.run import report

    signals.new_run()  # no handlers here, but the end must be unclaimed for this run's watchdog
    ctx = distributed.setup(config.device, config.dist_timeout_s, config.dist_group, settings=config)
    try:
        results = trainer.run(config, ctx, reuse)
    except (ConfigError, DataError) as exc:  # as the command line does: the run folder says why it stopped
        if not isinstance(exc, distributed.PeerDataError):  # the ranks waiting for this one's data stop waiting
            distributed.announce_stop(ctx, str(exc))
        report.stop_open_logs("failed", str(exc))
        raise
    except signals.StopRun as exc:
        report.stop_open_logs(type(exc).__name__.lower(), str(exc))
        raise
    finally:
        distributed.teardown(ctx)
    return [
        TrainedRun(r.model, ModelInfo(config, r.classes, CIFAR10_MEAN, CIFAR10_STD, r.test_acc), r) for r in results
    ]


def resolve_model(model, device="cpu") -> tuple[torch.nn.Module, ModelInfo]:
    """A model file's path, ``(network, ModelInfo)``, or a ``TrainedRun`` -> (network, info).
    The network comes back in eval mode, fp32, on ``device``; the caller's is never moved or cast:
    when it is not fp32 on ``device``, a copy is."""
    if isinstance(model, (str, Path)):
        return load_model(model, device)
    if isinstance(model, TrainedRun):
        net, info = model.model, model.info
    elif isinstance(model, tuple) and len(model) == 2 and isinstance(model[1], ModelInfo):
        net, info = model
    else:
        raise TypeError("expected a model file path, (model, ModelInfo) from load_model, or a run from train()")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" is the current device ("cuda" != "cuda:0")
        device = torch.device("cuda", torch.cuda.current_device())
    first = next(net.parameters())
    if first.dtype != torch.float32 or first.device != device:  # a copy: the caller's network stays as it is
        net = copy.deepcopy(net).to(device=device, dtype=torch.float32)
        if device.type != "cuda":  # compiled Triton kernels take CUDA tensors only (load_model(p, "cuda")'s net)
            as_plain_torch(net)
    return net.eval(), info
