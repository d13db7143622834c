"""fastcifar.export: write a saved model as an ONNX file.

    fastcifar export runs/<run>/model.safetensors --onnx model.onnx [--opset 17] [--force]
    python -m fastcifar.export runs/<run>/model.safetensors --onnx model.onnx

The ONNX model's contract (also in ``--help`` and the README):

    input   "images": float32 (N, 3, 32, 32), RGB pixel values 0..255 (an image's uint8 values as
            floats, channels first); N, the batch, is free
    output  "logits": float32 (N, classes), in the model file's class order; softmax for
            probabilities

The normalization the model file records (per-channel mean and std, in 0..255 units) is baked in
as the graph's first step, ``(x - mean) * (1 / std)``, computed as the trainer computes it, so a
caller feeds raw pixels and needs nothing from this package. The network is exported in eval mode
(batchnorm uses its running statistics), in fp32, from the CPU, with torch's TorchScript-based
exporter (``dynamo=False``: it needs the ``onnx`` package and nothing more). No test-time
augmentation: the logits are the plain forward's, ``fastcifar.predict --tta 0``'s. When
onnxruntime is installed the written file is run once on random images and checked against the
PyTorch model.

Installing: ``pip install -e '.[onnx]'`` from the checkout (onnx and onnxruntime); training never needs them.
"""

from __future__ import annotations

import io
import sys
import warnings
from pathlib import Path

import torch

from fastcifar.cli import run_command
from fastcifar.core import optional
from fastcifar.core.atomic import output_problem, write_atomic
from fastcifar.core.config import ConfigError
from fastcifar.core.errors import first_line
from fastcifar.core.options import OneLineParser
from fastcifar.core.readfile import kind
from fastcifar.data import DataError
from fastcifar.models.files import load_model

DEFAULT_OPSET = 17
MIN_OPSET = 11  # reflect padding and the ops the networks use are all there by 11


def max_opset() -> int:
    """The newest opset torch's TorchScript-based exporter writes (20 in torch 2.14)."""
    try:
        from torch.onnx import _constants

        return int(_constants.ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET)
    except (ImportError, AttributeError):  # a torch that moved it: let the exporter judge
        return 10**6


INPUT_NAME, OUTPUT_NAME = "images", "logits"
ONNX_FIX = "pip install onnx onnxruntime (or pip install -e '.[onnx]' in the checkout)"
CHECK_TOLERANCE = 1e-4  # onnxruntime against PyTorch after the export: max |difference| / max(1, max |logit|)


class Normalized(torch.nn.Module):
    """The network behind the model file's normalization: NCHW float 0..255 pixels -> logits."""

    def __init__(self, net: torch.nn.Module, mean, std):
        super().__init__()
        self.net = net
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("inv_std", 1.0 / torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net((images - self.mean) * self.inv_std).float()


def onnx_bytes(net: torch.nn.Module, mean, std, opset: int = DEFAULT_OPSET) -> bytes:
    """The ONNX file of ``net`` (fp32, on the CPU, in eval mode) behind the normalization ``mean``,
    ``std`` (0..255 units), with a free batch axis."""
    optional.load("onnx", ONNX_FIX, "export")  # the TorchScript exporter writes its protobuf with it
    model = Normalized(net.float().cpu().eval(), mean, std).eval()
    example = torch.rand(2, 3, 32, 32) * 255
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation notes: not the user's to act on
        torch.onnx.export(
            model,
            (example,),
            buffer,
            dynamo=False,
            opset_version=opset,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
        )
    return buffer.getvalue()


def check_with_onnxruntime(blob: bytes, net: torch.nn.Module, mean, std) -> float | None:
    """Max |logit difference| of onnxruntime on ``blob`` against ``net`` on 5 random images, over
    max(1, the largest |logit|); None when onnxruntime is not installed (one line when it is and
    cannot be imported)."""
    if not optional.installed("onnxruntime"):
        return None
    onnxruntime = optional.load("onnxruntime", ONNX_FIX, "the export's check")
    images = torch.rand(5, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 255
    session = onnxruntime.InferenceSession(blob, providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run([OUTPUT_NAME], {INPUT_NAME: images.numpy()})[0])
    with torch.no_grad():
        want = Normalized(net, mean, std).eval()(images)
    return float((got - want).abs().max() / max(1.0, float(want.abs().max())))


def export(model_path, out, *, opset: int = DEFAULT_OPSET, force: bool = False, log=print) -> Path:
    """Write the model file ``model_path`` as the ONNX file ``out`` (contract: module docstring)."""
    out = Path(out)
    if not MIN_OPSET <= opset <= max_opset():  # before the exporter, which prints its graph on a bad one
        newest = max_opset()
        allowed = f"lie in {MIN_OPSET}..{newest}" if newest < 10**6 else f"be at least {MIN_OPSET}"
        raise ConfigError(f"--opset must {allowed}, not {opset}")
    if out.is_dir():
        raise ConfigError(f"{out} is a folder; --onnx takes a file name, e.g. {out / 'model.onnx'}")
    problem = output_problem(out, [model_path], "--onnx")  # the model itself: refused, --force or not
    if problem is not None:
        raise ConfigError(problem)
    if out.exists() and not force:
        raise ConfigError(f"{out} exists; pass --force to overwrite it")
    if out.exists() and not out.is_file():  # --force renames over it: never over /dev/null or a FIFO
        raise ConfigError(f"{out} is {kind(out.stat().st_mode)}, not a regular file; --force replaces only a file")
    net, info = load_model(model_path, "cpu")
    try:
        blob = onnx_bytes(net, info.mean, info.std, opset)
    except ConfigError:
        raise
    except Exception as exc:  # an opset the exporter lacks, an op it cannot write
        raise ConfigError(
            f"ONNX export failed at opset {opset}: {first_line(str(exc)) or type(exc).__name__}"
        ) from None
    diff = check_with_onnxruntime(blob, net, info.mean, info.std)
    if diff is not None and not diff <= CHECK_TOLERANCE:
        raise DataError(
            f"the exported graph disagrees with the model (relative logit difference {diff:.3g} "
            f"> {CHECK_TOLERANCE:g} under onnxruntime); nothing written"
        )
    problem = output_problem(out, [model_path], "--onnx")  # again: the export took seconds
    if problem is not None:
        raise ConfigError(problem)
    try:
        write_atomic(out, blob, replace=force)  # without --force, a file made meanwhile (another export) is kept
    except FileExistsError:
        raise ConfigError(f"{out} exists; pass --force to overwrite it") from None
    except OSError as exc:
        raise DataError(f"cannot write {out}: {exc.strerror or type(exc).__name__}") from None
    cfg = info.config
    log(
        f"wrote {out} ({len(blob):,} bytes): {cfg.arch} {','.join(map(str, cfg.widths))}, "
        f"{len(info.classes)} classes, opset {opset}, input {INPUT_NAME} float32 (N, 3, 32, 32) 0..255 RGB, "
        f"output {OUTPUT_NAME} (N, {len(info.classes)})"
    )
    log(
        f"checked with onnxruntime: relative logit difference {diff:.2g}"
        if diff is not None
        else "not checked: onnxruntime is not installed (pip install onnxruntime)"
    )
    return out


def main(argv: list[str] | None = None, prog: str = "python -m fastcifar.export") -> int:
    parser = OneLineParser(
        prog=prog,
        description=(
            "Write a saved model as an ONNX file. Input 'images': float32 (N, 3, 32, 32), RGB pixel "
            "values 0..255 (uint8 values as floats, channels first), any batch size N; the model "
            "file's normalization is baked in as the graph's first step. Output 'logits': float32 "
            "(N, classes) in the model file's class order. Eval mode, fp32, no test-time augmentation "
            "(the logits of predict --tta 0). Needs the onnx package; with onnxruntime installed the "
            "file is checked against the PyTorch model. pip install -e '.[onnx]' installs both."
        ),
    )
    parser.add_argument("model", help="a model file written by the trainer (model.safetensors)")
    parser.add_argument("--onnx", required=True, metavar="OUT.onnx", help="the ONNX file to write")
    parser.add_argument(
        "--opset",
        type=int,
        default=DEFAULT_OPSET,
        help=f"ONNX opset version, {MIN_OPSET}..{max_opset()} (default: {DEFAULT_OPSET})",
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing output file")
    args = parser.parse_args(argv)
    return run_command(lambda: _run(args))


def _run(args) -> int:
    export(args.model, args.onnx, opset=args.opset, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
