"""fastcifar.evaluate: the test accuracy, overall and per class, of a saved model.

    python -m fastcifar.evaluate runs/<run>/model.safetensors --data data [--tta 0|1|2]

The model file carries everything needed (``fastcifar.checkpoint``): architecture, widths, class
names, normalization. By default the evaluation is the run's own: its TTA level and share, its
evaluation batch size and, if it trained on ``--subset``, the same fixed test subset, so on the
same data it prints the accuracy recorded in the file (to the last digit on the CPU; a model
trained in fp16 on a GPU and evaluated here in fp32 may differ by a few images, and with a TTA
share below 1 so may a run on several ranks, whose shards were cut into other batches).
``--subset 0`` takes the whole test set. Any layout ``--data`` accepts in training works here.

Also ``fastcifar.evaluate(model, data)`` from Python (``fastcifar.api``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fastcifar.api import resolve_model
from fastcifar.cli import make_callable, run_command
from fastcifar.core.config import CHOICES, ConfigError
from fastcifar.core.options import OneLineParser
from fastcifar.data import DataError, Dataset, load_dataset
from fastcifar.data.loader import EvalSet
from fastcifar.models.files import ModelInfo, load_model
from fastcifar.ops.tta import share_views, tta_logits, views_logits


@dataclass
class Evaluation:
    accuracy: float  # % of the test images
    loss: float  # mean cross-entropy (no label smoothing)
    count: int  # test images
    tta: int
    per_class: dict  # class name -> accuracy %
    per_class_count: dict  # class name -> test images of that class
    predictions: np.ndarray  # (count,) predicted label per test image


def resolve_tta(tta: int | None, cfg) -> int:
    """``None``: the run's own TTA level."""
    tta = cfg.tta if tta is None else tta
    if tta not in CHOICES["tta"]:
        raise ConfigError(f"--tta must be one of {', '.join(map(str, CHOICES['tta']))}, not {tta}")
    return tta


@torch.no_grad()
def logits_of(
    model: torch.nn.Module,
    images: np.ndarray,
    *,
    mean,
    std,
    tta: int,
    batch_size: int,
    device="cpu",
    tta_share: float = 1.0,
    tta_scope: str = "batch",
) -> torch.Tensor:
    """(N, classes) fp32 logits on the CPU of uint8 NHWC ``images``, batched, normalized and laid
    out as the trainer's evaluation lays them out (channels-last, the model's dtype); the TTA views
    go to the ``tta_share`` of each batch least sure of its class, as in the trainer, or with
    ``tta_scope`` "test" to that share of all of ``images``."""
    model.eval()
    batches = EvalSet(
        images,
        np.zeros(len(images), dtype=np.int64),
        batch_size,
        dtype=next(model.parameters()).dtype,
        device=torch.device(device),
        mean=mean,
        std=std,
    )
    if tta_scope == "test" and tta and tta_share < 1.0:
        plain = torch.cat([model(x).float() for x, _ in batches])

        def views(rows: torch.Tensor) -> torch.Tensor:
            return views_logits(model, batches.images.index_select(0, rows), tta)

        return share_views(plain, tta_share, batch_size, views).cpu()
    return torch.cat([tta_logits(model, x, tta, tta_share).float().cpu() for x, _ in batches])


def evaluate_arrays(
    model: torch.nn.Module,
    images: np.ndarray,
    labels: np.ndarray,
    classes,
    *,
    mean,
    std,
    tta: int,
    batch_size: int = 1000,
    device="cpu",
    tta_share: float = 1.0,
    tta_scope: str = "batch",
) -> Evaluation:
    """Accuracy of ``model`` on uint8 NHWC ``images`` with integer ``labels``."""
    logits = logits_of(
        model,
        images,
        mean=mean,
        std=std,
        tta=tta,
        batch_size=batch_size,
        device=device,
        tta_share=tta_share,
        tta_scope=tta_scope,
    )
    loss = F.cross_entropy(logits, torch.from_numpy(labels).long(), reduction="sum").item()
    pred = logits.argmax(1).numpy()
    correct = pred == labels
    per_class, per_count = {}, {}
    for k, name in enumerate(classes):
        mine = labels == k
        per_count[name] = int(mine.sum())
        per_class[name] = 100.0 * float(correct[mine].mean()) if mine.any() else float("nan")
    return Evaluation(100.0 * float(correct.mean()), loss / len(labels), len(labels), tta, per_class, per_count, pred)


def check_classes(info: ModelInfo, data: Dataset) -> None:
    if tuple(info.classes) != tuple(data.classes):
        raise DataError(
            f"{data.source}: its {len(data.classes)} classes are not the model's {len(info.classes)} "
            f"(model: {', '.join(info.classes[:5])}...; data: {', '.join(data.classes[:5])}...)"
        )


def evaluate(
    model,
    data,
    *,
    tta: int | None = None,
    subset: int | None = None,
    batch_size: int | None = None,
    device="cpu",
    cache_dir=None,
    log=lambda msg: None,
) -> Evaluation:
    """``model``: a model file's path, or ``(network, ModelInfo)`` as ``load_model`` returns;
    ``data``: a path in any layout, or a loaded ``Dataset``. ``None`` settings take the run's."""
    net, info = resolve_model(model, device)
    cfg = info.config
    if not isinstance(data, Dataset):
        data = load_dataset(data, cache_dir=cache_dir, log=log, offer_download=False)  # evaluate has no --download
    check_classes(info, data)
    subset = cfg.subset if subset is None else subset
    if subset:
        data = data.subset(subset)
        log(f"note: the test images of --subset {subset}, as in training (--subset 0 for all)")
    return evaluate_arrays(
        net,
        data.test_images,
        data.test_labels,
        info.classes,
        mean=info.mean,
        std=info.std,
        tta=resolve_tta(tta, cfg),
        batch_size=batch_size or cfg.eval_batch_size,
        device=device,
        tta_share=cfg.tta_share,
        tta_scope=cfg.tta_scope,
    )  # the run's: its views went to that share of each batch, or of the test set


def _share(cfg) -> str:
    where = "the test set" if cfg.tta_scope == "test" else "each batch"
    return f" on the least sure {cfg.tta_share:.0%} of {where}" if cfg.tta_share < 1 else ""


def main(argv: list[str] | None = None, prog: str = "python -m fastcifar.evaluate") -> int:
    parser = OneLineParser(prog=prog, description="Test accuracy (overall and per class) of a saved model.")
    parser.add_argument("model", help="a model file written by the trainer (model.safetensors)")
    parser.add_argument("--data", required=True, help="the data set, in any layout the trainer accepts")
    parser.add_argument(
        "--tta",
        type=int,
        choices=CHOICES["tta"],
        default=None,
        help="test-time augmentation level (default: the run's)",
    )
    parser.add_argument(
        "--subset",
        type=int,
        default=None,
        help="evaluate on the test subset of --subset N (default: the run's; 0 = whole test set)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="images per batch (default: the run's; with a TTA share below 1 it decides which images share the views)",
    )
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--cache-dir", default="", help="decoded-image cache, as in training")
    args = parser.parse_args(argv)
    return run_command(lambda: _report(args))


def _report(args) -> int:
    if args.subset is not None and args.subset < 0 or args.batch_size is not None and args.batch_size <= 0:
        raise ConfigError("--subset must not be negative and --batch-size must be positive")
    device = torch.device(args.device)
    net, info = load_model(args.model, device)
    cfg = info.config
    recorded = "none recorded" if info.test_acc is None else f"recorded test_acc {info.test_acc:.2f}%"
    print(
        f"model: {args.model} ({cfg.arch} {','.join(map(str, cfg.widths))}, {len(info.classes)} classes, "
        f"{recorded} with TTA {cfg.tta}{_share(cfg)})"
    )
    result = evaluate(
        (net, info),
        args.data,
        tta=args.tta,
        subset=args.subset,
        batch_size=args.batch_size,
        device=device,
        cache_dir=args.cache_dir or None,
        log=print,
    )
    print(
        f"test_acc {result.accuracy:.2f}% (TTA {result.tta}{_share(cfg) if result.tta else ''}, "
        f"{result.count} images), loss {result.loss:.4f}"
    )
    width = max(len(name) for name in info.classes)
    print("per class:")
    for name in info.classes:
        print(f"  {name:<{width}} {result.per_class[name]:7.2f}%  ({result.per_class_count[name]} images)")
    return 0


# `fastcifar.evaluate(...)` is this function, also after `import fastcifar.evaluate` (see fastcifar.api).
make_callable(__name__, evaluate)

if __name__ == "__main__":
    sys.exit(main())
