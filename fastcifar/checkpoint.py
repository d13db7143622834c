"""``python -m fastcifar.checkpoint``: inspect sparse diffs, or restore a model from a chain of them.

    python -m fastcifar.checkpoint inspect RUN_DIR/sparse/run1/*.safetensors
    python -m fastcifar.checkpoint restore BASE DIFF [DIFF ...] --out model.safetensors [--data PATH]
    python -m fastcifar.checkpoint seal OLD.safetensors --out NEW.safetensors

A run with ``--sparse-checkpoints`` writes a base model file and one sparse diff per epoch
(``fastcifar.run.sparse.diffs``). ``restore`` writes the model file of the last diff's epoch; with
``--data`` it also evaluates it on the test set as the trainer does (its TTA, on the CPU) and
prints the accuracy. ``seal`` writes a copy of a model file written before model files carried a
digest (``fastcifar.models.files``), with one: the files are refused without it, and sealing says
the user vouches for the bytes as they are. Its contents are checked as every load checks them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from fastcifar.cli import run_command
from fastcifar.core.atomic import output_problem
from fastcifar.core.names import printable
from fastcifar.core.options import OneLineParser
from fastcifar.evaluate import evaluate
from fastcifar.models.files import (
    DIGEST_KEY,
    MODEL_FORMAT,
    CheckpointError,
    model_info,
    network_from_weights,
    read_safetensors,
    save_weights,
    write_safetensors,
)
from fastcifar.run.sparse import diffs


def evaluate_state(state: dict[str, torch.Tensor], meta: dict[str, str], data: str) -> float:
    """Test accuracy (%) of a restored state, evaluated as ``python -m fastcifar.evaluate`` does
    (the run's TTA and test subset, fp32, CPU)."""
    net, info = network_from_weights(state, meta, "restored state")
    return evaluate((net, info), data, cache_dir=info.config.cache_dir or None).accuracy


def inspect_lines(path: str | Path) -> list[str]:
    tensors, meta = read_safetensors(path, "model file or sparse diff")
    size = Path(path).stat().st_size
    n = sum(t.numel() for t in tensors.values())
    if meta.get("format") == MODEL_FORMAT:
        return [f"{printable(str(path))}: model file, {len(tensors)} tensors, {n:,} values, {size:,} bytes"]
    if "format" not in meta:  # safetensors.torch.save_file's: neither a model file nor a diff
        return [
            f"{printable(str(path))}: plain safetensors file (no fastcifar metadata), {len(tensors)} tensors, "
            f"{n:,} values, {size:,} bytes"
        ]
    lines = [  # the metadata's text escaped: a control character in it cannot reach the terminal
        printable(
            f"{path}: sparse diff, epoch {meta.get('epoch')}, parent {meta.get('parent')}, "
            f"test_acc {meta.get('test_acc')}, {size:,} bytes"
        )
    ]
    for key, t in tensors.items():
        if key.endswith("/idx"):
            lines.append(printable(f"  {key[len('param/') : -len('/idx')]}: {t.numel():,} entries"))
        elif key.startswith("buffer/"):
            lines.append(printable(f"  {key[len('buffer/') :]}: dense {tuple(t.shape)}"))
    return lines


def main(argv: list[str] | None = None, prog: str = "python -m fastcifar.checkpoint") -> int:
    parser = OneLineParser(
        prog=prog,
        description=(
            "Inspect sparse diffs, restore a model from a base file and a chain of them, or seal an older "
            "model file (written before digests) with one."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ins = sub.add_parser(
        "inspect",
        help="what each file holds",
        description="What each model file or sparse diff (--sparse-checkpoints) holds.",
    )
    ins.add_argument("files", nargs="+", help="model files or sparse diffs (RUN/sparse/runN/*.safetensors)")
    res = sub.add_parser(
        "restore",
        help="base file + diffs in epoch order -> one model file",
        description="A model file from a sparse-diff chain: the base, then the diffs in epoch order.",
    )
    res.add_argument("base", help="the chain's base model file (RUN/sparse/runN/base.safetensors)")
    res.add_argument("diffs", nargs="*", help="the diffs to apply, in epoch order")
    res.add_argument("--out", default="", help="model file to write (the base's format); empty: none")
    res.add_argument("--data", default="", help="evaluate the restored model on this data's test set")
    sea = sub.add_parser(
        "seal",
        help="a copy of an older model file, with the digest loads require",
        description=(
            "A copy of a model file written before model files carried a digest, with one (model "
            "files without it are refused). Seal only a file you trust as it is: the digest then "
            "vouches for its bytes."
        ),
    )
    sea.add_argument("file", help="the model file without a digest")
    sea.add_argument("--out", required=True, help="the model file to write (not overwritten)")
    args = parser.parse_args(argv)
    return run_command(lambda: _run(args))


def _run(args) -> int:
    if args.command == "inspect":
        for f in args.files:
            print("\n".join(inspect_lines(f)))
        return 0
    if args.command == "seal":
        _check_out(args.out, [args.file])
        return _seal(args.file, args.out)
    if args.out:  # before the chain is read, which can take long
        _check_out(args.out, [args.base, *args.diffs])
    state, meta = diffs.restore(args.base, args.diffs)  # meta: the restored model's (the last diff's test_acc)
    if args.out:
        info = model_info(meta, args.base)
        save_weights(args.out, state, info.config, info.classes, info.test_acc, info.mean, info.std, replace=False)
        print(f"wrote {args.out}")
    if args.data:
        print(f"test_acc {evaluate_state(state, meta, args.data):.4f}")
    return 0


def _check_out(out: str, inputs: list[str]) -> None:
    """``--out`` onto one of the inputs, into a missing folder, or onto an existing file: one line
    (save_weights refuses an existing file too, without a race)."""
    problem = output_problem(out, inputs, "--out")
    if problem is not None:
        raise CheckpointError(problem)
    if Path(out).exists():
        raise CheckpointError(f"{out} exists; not overwriting it")


def _seal(path: str, out: str) -> int:
    tensors, meta = read_safetensors(path, fmt=MODEL_FORMAT)  # a digest it does carry is checked here
    if DIGEST_KEY in meta:
        raise CheckpointError(f"{path}: carries a digest already (and it matches): nothing to do")
    network_from_weights(tensors, meta, path)  # every check a load makes, before vouching for it
    write_safetensors(out, tensors, meta, replace=False)
    print(f"wrote {out}: {path}'s contents, with their digest")
    return 0


if __name__ == "__main__":
    sys.exit(main())
