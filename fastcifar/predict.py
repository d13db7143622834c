"""fastcifar.predict: classify your own images with a saved model.

    python -m fastcifar.predict runs/<run>/model.safetensors cat.png photos/ [--top 3] [--json]

Each argument is an image or a folder (its images, recursively, in sorted order). Every image is
converted to RGB; one that is not 32x32 is resized to 32x32 (bilinear, aspect ratio not kept) with
a note on stderr, up to 8192x8192 pixels: a larger one (a decompression bomb) is refused by its
header, before its pixels are decoded. A file that cannot be read (missing, no permission, a symlink
loop, a FIFO, not an image, too large) gets one line on stderr and the others still run.
Prints, per image, the top classes with their softmax probabilities (the model's TTA level unless
``--tta``); ``--json`` prints one JSON document instead. Exit status: 0 when every image was
classified, 1 when some could not be read, 2 on a bad model file or arguments, or no image at all.

Also ``fastcifar.predict(model, images)`` from Python (``fastcifar.api``).
"""

from __future__ import annotations

import io
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from fastcifar.api import resolve_model
from fastcifar.cli import make_callable, run_command
from fastcifar.core.config import CHOICES, ConfigError
from fastcifar.core.names import printable
from fastcifar.core.options import OneLineParser
from fastcifar.core.readfile import read_regular, why
from fastcifar.data import DataError
from fastcifar.data.folder import IMAGE_SUFFIXES, bomb_warnings_as_errors, open_image
from fastcifar.evaluate import logits_of, resolve_tta

SIZE = 32


@dataclass
class Prediction:
    path: str
    top: list = field(default_factory=list)  # [(class name, probability), ...], most probable first
    resized_from: tuple | None = None  # (width, height) of an image that was not 32x32
    error: str = ""  # why the image could not be read ("" when it was classified)


def image_files(paths) -> list[Path]:
    """The arguments, with each folder replaced by its image files (recursively, sorted)."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            # not is_file(): a symlink loop or a FIFO named like an image is reported when read, not skipped
            files += sorted(f for f in p.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES and not f.is_dir())
        else:
            files.append(p)
    return files


def read_image(path: Path) -> tuple[np.ndarray, tuple | None]:
    """(32, 32, 3) uint8 and the original (width, height) if it had to be resized, else None.
    OSError (the OS's reason) for a file that cannot be read or is not a regular file (a FIFO is
    refused, not waited on); DataError for an image too large to decode, refused by its header."""
    raw = read_regular(path)
    with bomb_warnings_as_errors(), open_image(io.BytesIO(raw), str(path)) as img:
        img.seek(0)  # an animated GIF or a multi-page TIFF: its first frame
        img = img.convert("RGB")
        size = img.size
        if size != (SIZE, SIZE):
            img = img.resize((SIZE, SIZE), Image.Resampling.BILINEAR)
        return np.asarray(img, dtype=np.uint8), (size if size != (SIZE, SIZE) else None)


def predict(
    model, images, *, top: int = 3, tta: int | None = None, device="cpu", batch_size: int = 500, warn=lambda msg: None
) -> list[Prediction]:
    """``model``: a model file's path, ``(network, ModelInfo)`` or a run from ``train()``;
    ``images``: image files and folders, or a uint8 array (N, 32, 32, 3). One Prediction per image,
    in order; unreadable files come back with ``error`` set (and ``warn`` is called with one line)."""
    net, info = resolve_model(model, device)
    tta = resolve_tta(tta, info.config)
    if top <= 0:
        raise ConfigError(f"--top must be positive, not {top}")
    if isinstance(images, np.ndarray):
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (SIZE, SIZE, 3):
            raise DataError(f"images must be uint8 (N, 32, 32, 3), not {images.dtype} {images.shape}")
        results, arrays = [Prediction(f"[{i}]") for i in range(len(images))], list(images)
    else:
        results, arrays = [], []
        for path in image_files(images):
            try:
                array, resized = read_image(path)
            except DataError as exc:  # too large: the message names the file already
                error = str(exc).removeprefix(f"{path}: ")
            except UnidentifiedImageError:
                error = "not a readable image (no format PIL knows)"
            except (ValueError, SyntaxError, EOFError) as exc:
                error = f"not a readable image ({exc})"
            except OSError as exc:
                error = f"not a readable image ({exc})" if exc.filename is None else f"cannot read: {why(exc)}"
            else:
                error = ""
            if error:
                results.append(Prediction(str(path), error=error))
                warn(f"{printable(str(path))}: {printable(error)}")
                continue
            if resized:
                warn(f"note: {printable(str(path))}: resized from {resized[0]}x{resized[1]} to 32x32")
            results.append(Prediction(str(path), resized_from=resized))
            arrays.append(array)
    readable = [r for r in results if not r.error]
    if arrays:
        probs = logits_of(
            net, np.stack(arrays), mean=info.mean, std=info.std, tta=tta, batch_size=batch_size, device=device
        ).softmax(1)
        k = min(top, probs.shape[1])
        values, indices = probs.topk(k, dim=1)
        for r, v, i in zip(readable, values.tolist(), indices.tolist(), strict=True):
            r.top = [(info.classes[c], p) for c, p in zip(i, v, strict=True)]
    return results


def main(argv: list[str] | None = None, prog: str = "python -m fastcifar.predict") -> int:
    parser = OneLineParser(prog=prog, description="Top classes, with probabilities, of each image.")
    parser.add_argument("model", help="a model file written by the trainer (model.safetensors)")
    parser.add_argument("images", nargs="+", help="image files or folders of images")
    parser.add_argument("--top", type=int, default=3, help="classes to print per image")
    parser.add_argument(
        "--tta",
        type=int,
        choices=CHOICES["tta"],
        default=None,
        help="test-time augmentation level (default: the run's)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    args = parser.parse_args(argv)
    return run_command(lambda: _report(args))


def _report(args) -> int:
    warn = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    results = predict(args.model, args.images, top=args.top, tta=args.tta, device=args.device, warn=warn)
    if not results:
        raise DataError(f"no image files in {printable(' '.join(args.images))}")
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "predictions": [
                        {**asdict(r), "top": [{"class": c, "probability": p} for c, p in r.top]} for r in results
                    ],
                },
                indent=2,
            )
        )
    else:
        for r in results:
            if not r.error:
                # a file name may hold a newline or a bidi override: escaped, one line per image
                print(f"{printable(r.path)}: " + ", ".join(f"{printable(c)} {p:.3f}" for c, p in r.top))
    return 1 if any(r.error for r in results) else 0


# `fastcifar.predict(...)` is this function, also after `import fastcifar.predict` (see fastcifar.api).
make_callable(__name__, predict)

if __name__ == "__main__":
    sys.exit(main())
