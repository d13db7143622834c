"""Loader benchmark: DALI vs the plain-torch loader, per epoch and at start-up.

    python bench/bench_loader.py                       # CUDA if present, else the CPU-sized run
    python bench/bench_loader.py --device cpu --images 5120

Per loader and per-rank batch (256, 512):
  * images/s of the loader alone over whole epochs (one warm-up epoch first);
  * on CUDA, the share of step time the loader costs when overlapped with a training step:
    (ms per step with the loader - ms per step on a fixed batch) / ms per step with the loader,
    the step being ResNet-9 forward + backward + SGD in fp16 autocast, eager (no CUDA graph);
  * start-up: decoding the whole JPEG set, DALI (nvJPEG on CUDA, libjpeg-turbo on CPU) vs PIL.
On a machine without CUDA it runs the CPU-sized version (DALI's CPU backend, ``--images`` training
images, no step share: DALI and torch would share the same cores as the step) and says so; it
never reports a GPU figure it did not measure. Prints markdown tables; appends one JSON line per
figure to bench/results/loader.jsonl with device, versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import platform
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastcifar.data.dali import DaliLoader, dali_available, decode_jpegs
from fastcifar.data.loader import TorchLoader
from fastcifar.ops.augment import AugmentSpec

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "cifar10-jpeg.tar.gz"
RESULTS = ROOT / "bench" / "results" / "loader.jsonl"


def read_jpeg_tar(path: Path) -> tuple[list[bytes], np.ndarray, list[bytes], np.ndarray]:
    """Encoded train and test JPEGs of an image-folder .tar.gz, labels from sorted class folders."""
    files: dict[str, list[tuple[str, str, bytes]]] = {"train": [], "test": []}
    with tarfile.open(path) as tar:
        for m in tar:
            parts = m.name.split("/")
            if m.isfile() and m.name.lower().endswith((".jpg", ".jpeg")) and len(parts) >= 3 and parts[-3] in files:
                files[parts[-3]].append((parts[-2], m.name, tar.extractfile(m).read()))
    classes = sorted({c for split in files.values() for c, _, _ in split})
    out = []
    for split in ("train", "test"):
        items = sorted(files[split])
        out += [[b for _, _, b in items], np.array([classes.index(c) for c, _, _ in items], dtype=np.int64)]
    return tuple(out)


def pil_decode(encoded: list[bytes]) -> np.ndarray:
    from PIL import Image

    return np.stack([np.asarray(Image.open(io.BytesIO(e)).convert("RGB")) for e in encoded])


def torch_loader(images, labels, batch, device, seed):
    """The torch side: the trainer's TorchLoader over the whole set as one shard."""
    shard = np.arange(len(images))
    loader = TorchLoader(
        images,
        labels,
        shard,
        batch,
        len(shard) // batch,
        augment=AugmentSpec(),
        dtype=torch.float16 if device.type == "cuda" else torch.float32,
        device=device,
    )
    loader.set_epoch(seed, 0)
    return loader


def make_loader(name, images, labels, batch, device, seed=0):
    if name == "dali":
        return DaliLoader(images, labels, None, batch, device=device, seed=seed)
    return torch_loader(images, labels, batch, device, seed)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_epochs(loader, epochs: int, device, step=None) -> float:
    """Seconds per step over ``epochs`` epochs after one warm-up epoch; ``step(x, y)`` runs per batch."""
    for epoch in range(epochs + 1):
        if epoch == 1:
            sync(device)
            start = time.perf_counter()
        loader.set_epoch(0, epoch)
        for x, y in loader:
            if step is not None:
                step(x, y)
    sync(device)
    return (time.perf_counter() - start) / (epochs * len(loader))


def make_step(device):
    from fastcifar.models.resnet9 import ResNet9

    model = ResNet9().to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)

    def step(x, y):
        with torch.autocast(device.type, dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def step_only(step, batch, device, steps: int) -> float:
    x = torch.randn(batch, 3, 32, 32, device=device, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device=device)
    for _ in range(10):
        step(x, y)
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    sync(device)
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="image-folder .tar.gz of JPEGs")
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 512], help="images per rank per step")
    ap.add_argument("--loaders", nargs="+", default=["dali", "torch"], choices=["dali", "torch"])
    ap.add_argument("--epochs", type=int, default=2, help="timed epochs, after one warm-up epoch")
    ap.add_argument("--images", type=int, default=None, help="training images used (default: all on CUDA, 5120 on CPU)")
    ap.add_argument("--no-record", action="store_true", help=f"do not append to {RESULTS.relative_to(ROOT)}")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "bench_loader: --device cuda but torch sees no CUDA GPU; run with --device cpu for the CPU-sized version"
        )
    ok, dali_version = dali_available()
    if not ok and "dali" in args.loaders:
        print(f"note: DALI unavailable ({dali_version}); timing the torch loader only")
        args.loaders = [name for name in args.loaders if name != "dali"]

    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    )
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": name,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "dali": dali_version if ok else "unavailable",
        "numpy": np.__version__,
    }
    print(" | ".join(f"{k} {v}" for k, v in meta.items()))

    if args.data.is_file():
        t0 = time.perf_counter()
        train_enc, train_labels, test_enc, test_labels = read_jpeg_tar(args.data)
        print(f"read {len(train_enc) + len(test_enc)} JPEGs from {args.data} in {time.perf_counter() - t0:.2f} s")
        data_name = args.data.name
    else:
        print(f"note: {args.data} not found; per-epoch figures on random images, no start-up decode")
        train_enc = test_enc = None
        data_name = "random"
    rows = []

    def record(loader, batch, metric, value, unit, images):
        rows.append(
            {
                **meta,
                "loader": loader,
                "batch": batch,
                "metric": metric,
                "value": round(value, 6),
                "unit": unit,
                "images": images,
                "data": data_name,
                "mode": "cuda" if device.type == "cuda" else "cpu-sized",
            }
        )

    # ---- start-up: decode the whole JPEG set ----
    startup = []
    if train_enc is not None:
        everything = train_enc + test_enc
        if "dali" in args.loaders:
            sync(device)
            t0 = time.perf_counter()
            train_images = decode_jpegs(train_enc, device)
            decode_jpegs(test_enc, device)
            sync(device)
            cold = time.perf_counter() - t0  # what a run pays: pipeline creation included
            t0 = time.perf_counter()
            decode_jpegs(everything, device)
            sync(device)
            warm = time.perf_counter() - t0
            startup += [("dali", cold, warm)]
            record("dali", 0, "startup_decode_s", cold, "s", len(everything))
            record("dali", 0, "startup_decode_warm_s", warm, "s", len(everything))
            train_images = train_images.cpu().numpy()
        t0 = time.perf_counter()
        pil = pil_decode(everything)
        t_pil = time.perf_counter() - t0
        startup += [("torch (PIL)", t_pil, float("nan"))]
        record("torch", 0, "startup_decode_s", t_pil, "s", len(everything))
        if "dali" not in args.loaders:
            train_images = pil[: len(train_enc)]
    else:
        train_images = np.random.default_rng(0).integers(0, 256, (50000, 32, 32, 3), dtype=np.uint8)
        train_labels = np.random.default_rng(1).integers(0, 10, 50000)

    n = args.images or (len(train_images) if device.type == "cuda" else 5120)
    images, labels = np.ascontiguousarray(train_images[:n]), train_labels[:n]

    # ---- per epoch ----
    step = make_step(device) if device.type == "cuda" else None
    table = []
    for batch in args.batches:
        t_step = step_only(step, batch, device, 50) if step else None
        for loader_name in args.loaders:
            loader = make_loader(loader_name, images, labels, batch, device)
            per_step = time_epochs(loader, args.epochs, device)
            record(loader_name, batch, "loader_images_per_s", batch / per_step, "images/s", n)
            share = None
            if step is not None:
                with_step = time_epochs(loader, args.epochs, device, step)
                share = max(0.0, (with_step - t_step) / with_step)
                record(loader_name, batch, "step_ms_with_loader", with_step * 1e3, "ms", n)
                record(loader_name, batch, "step_ms_fixed_batch", t_step * 1e3, "ms", n)
                record(loader_name, batch, "loader_share_of_step", share, "fraction", n)
            table.append((loader_name, batch, batch / per_step, per_step * 1e3, t_step, share))

    print(f"\n### Per epoch ({n} training images, {args.epochs} timed epochs, {name})\n")
    print("| loader | batch/rank | images/s (loader alone) | ms/batch | ms/step fixed batch | share of step |")
    print("|---|---:|---:|---:|---:|---:|")
    for loader_name, batch, ips, ms, t_step, share in table:
        step_ms = f"{t_step * 1e3:.2f}" if t_step is not None else "-"
        share_s = f"{100 * share:.1f}%" if share is not None else "- (CUDA only)"
        print(f"| {loader_name} | {batch} | {ips:,.0f} | {ms:.2f} | {step_ms} | {share_s} |")
    if startup:
        print(f"\n### Start-up: decode the whole JPEG set ({len(train_enc) + len(test_enc)} images)\n")
        print("| decoder | s (cold, as a run pays) | s (warm) | images/s (cold) |")
        print("|---|---:|---:|---:|")
        for dec, cold, warm in startup:
            warm_s = f"{warm:.3f}" if warm == warm else "-"
            print(f"| {dec} | {cold:.3f} | {warm_s} | {(len(train_enc) + len(test_enc)) / cold:,.0f} |")
    if device.type != "cuda":
        print("\nCPU-sized run: DALI's CPU backend; GPU figures unmeasured here.")
    if not args.no_record:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        with RESULTS.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"appended {len(rows)} rows to {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
