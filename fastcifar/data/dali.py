"""The DALI loader: one pipeline per rank that augments its fixed shard, and a JPEG decode-once.

Data flow per rank (the same code on the CPU backend, where tests run it):

* start-up: images are uint8 NHWC, resident on the rank's device (official CIFAR-10 arrives as
  arrays; an image folder is decoded once by ``decode_jpegs``, nvJPEG via device "mixed");
  the shard is gathered and padded once (reflect or zero), 50,000 x 40 x 40 x 3 = 240 MB;
* per epoch: the shard's order and every random parameter of the epoch come from
  ``loader.epoch_plan`` (host generators seeded from the run's order and aug streams,
  ``augment.draw_params`` itself): the torch loader's exact draws, so either loader gives the same run;
* per batch: a gather of the batch's padded images on a side stream feeds ``fn.external_source``
  (device memory, no host round trip); the parameters (a few hundred ints) are the argument
  inputs of one ``crop_mirror_normalize`` (crop from padding + flip + normalize + cast, fused),
  with ``--brightness``/``--contrast`` an add and a multiply by each image's shift and scale,
  and one ``erase`` (cutout, after normalization so the hole is the data set's mean colour);
* output: DALI's NHWC buffer handed to torch through DLPack, ``.permute(0, 3, 1, 2)`` so it is
  NCHW-shaped and channels-last with no copy; with static buffers bound (the CUDA-graph step),
  one device-to-device ``copy_`` into them. ``prefetch`` batches stay in flight, so DALI
  computes batch k+1 and k+2 while step k trains.

DALI is imported lazily: this module imports without it, and ``train_loader.resolve_loader`` turns
a missing or broken DALI into one clear line (``--loader dali``) or a one-line notice (the default).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from fastcifar.core import optional
from fastcifar.core.config import ConfigError
from fastcifar.core.signals import held
from fastcifar.core.streams import Streams, as_streams
from fastcifar.data.loader import EpochAhead, TrainLoader, data_set_index, epoch_plan, to_device
from fastcifar.ops.augment import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    DEFAULT_AUGMENT,
    AugmentParams,
    AugmentSpec,
    normalize,
    pad_images,
)

DECODE_BATCH = 4096  # JPEGs per decode iteration: 15 iterations for the 60,000 images


class DaliUnavailableError(ConfigError):
    """``--loader dali`` was asked for and DALI cannot be imported here."""


class JpegDecodeError(ValueError):
    """An encoded image could not be decoded, or decodes to the wrong shape."""


@functools.lru_cache(maxsize=1)
def dali_available() -> tuple[bool, str]:
    """(True, DALI's version) if DALI and its torch plugin import, else (False, why, in one line)."""
    try:
        with held():  # a Ctrl-C meanwhile is taken after the import, not inside libdali's init
            import nvidia.dali as dali
            import nvidia.dali.fn  # noqa: F401
            import nvidia.dali.plugin.pytorch  # noqa: F401
    except Exception as exc:  # ImportError, or OSError/RuntimeError from a broken libdali
        return False, optional.reason(exc)
    return True, f"DALI {dali.__version__}"


def _device_id(device: torch.device) -> int | None:
    """DALI's ``device_id``: the CUDA ordinal (the local rank), or None for the CPU backend."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        raise ValueError(f"DALI runs on cpu or cuda devices, not {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def _dali():
    """Import DALI or raise the one-line error (constructing a DALI object means DALI was asked for)."""
    ok, why = dali_available()
    if not ok:
        raise DaliUnavailableError(f"NVIDIA DALI cannot be imported ({why})")
    from nvidia.dali import Pipeline, fn, types

    return Pipeline, fn, types


class _InFlight:
    """Keeps up to ``depth`` iterations of a feed_input-driven pipeline scheduled ahead.

    DALI's first ``schedule_run`` runs ``depth`` iterations at once, so it needs ``depth`` inputs
    fed before it; every later one runs one. Every scheduled iteration is consumed, also after an
    abandoned pass (``drain``), so the pipeline never holds an input of a stale epoch.
    """

    def __init__(self, pipe, depth: int):
        self.pipe, self.depth = pipe, depth
        self.primed = False
        self.pending = 0

    def run(self, n: int, feed: Callable[[int], None], stream) -> Iterator[tuple]:
        """Feed iteration i with ``feed(i)`` for i < n and yield each iteration's outputs in order.

        The next iterations are scheduled before an output is yielded, so they run while the
        caller consumes it; the dynamic executor keeps released outputs valid while referenced.
        """
        fed = 0

        def top_up() -> None:
            nonlocal fed
            while self.pending < self.depth and fed < n:
                feed(fed)
                fed += 1
                self.pipe.schedule_run()
                self.pending += 1

        if not self.primed:
            if n < self.depth:
                raise ValueError(f"a pass of {n} iterations cannot prime a pipeline {self.depth} deep")
            for i in range(self.depth):
                feed(i)
            fed = self.depth
            self.pipe.schedule_run()
            self.primed, self.pending = True, self.depth
        else:
            top_up()
        for _ in range(n):
            outputs = self.pipe.share_outputs(stream)
            self.pending -= 1
            self.pipe.release_outputs()
            top_up()
            yield outputs

    def drain(self, stream) -> None:
        while self.pending:
            self.pipe.share_outputs(stream)
            self.pending -= 1
            self.pipe.release_outputs()


def _check_images(images, labels) -> tuple[torch.Tensor, torch.Tensor]:
    """NHWC uint8 square RGB images and matching 1-D integer labels, as torch tensors."""
    if not isinstance(images, (np.ndarray, torch.Tensor)):
        raise TypeError(f"images must be a numpy array or torch tensor, not {type(images).__name__}")
    images = torch.as_tensor(images)
    if images.dtype != torch.uint8:
        raise TypeError(f"images must be uint8, not {images.dtype}")
    if images.ndim != 4 or images.shape[3] != 3 or images.shape[1] != images.shape[2]:
        raise ValueError(f"images must be (N, S, S, 3) NHWC, not {tuple(images.shape)}")
    labels = torch.as_tensor(labels)
    if labels.dtype.is_floating_point or labels.dtype in (torch.bool, torch.complex64, torch.complex128):
        raise TypeError(f"labels must be integers, not {labels.dtype}")
    if labels.ndim != 1 or len(labels) != len(images):
        raise ValueError(f"labels must be ({len(images)},) to match the images, not {tuple(labels.shape)}")
    return images, labels.long()


class DaliLoader(TrainLoader):
    """Training batches of one rank's fixed shard, reshuffled every epoch, last partial batch dropped.

    Same constructor (the augmentation as one ``AugmentSpec``) and ``set_epoch(streams, epoch)``
    as ``fastcifar.data.loader.TorchLoader`` (``index`` and ``n_read``: the images' data-set indices),
    plus: ``seed`` (the run's streams, or a run seed, until ``set_epoch``),
    ``prefetch`` (batches computed ahead), ``num_threads`` (DALI's CPU threads) and
    ``params_fn(epoch, step, batch) -> AugmentParams``, which pins the random parameters (tests);
    by default they are drawn per epoch.
    Yields ``(images, labels)``: (B, 3, S, S) channels-last ``dtype`` and (B,) int64 on ``device``.
    """

    def __init__(
        self,
        images,
        labels,
        shard: np.ndarray | None,
        batch_size: int,
        steps_per_epoch: int | None = None,
        *,
        augment: AugmentSpec = DEFAULT_AUGMENT,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        rank: int = 0,
        mean=CIFAR10_MEAN,
        std=CIFAR10_STD,
        seed: Streams | int = 0,
        prefetch: int = 2,
        num_threads: int = 2,
        params_fn: Callable[[int, int, int], AugmentParams] | None = None,
        index: np.ndarray | None = None,
        n_read: int | None = None,
    ):
        Pipeline, fn, types = _dali()
        images, labels = _check_images(images, labels)
        device_id = _device_id(torch.device(device))
        self.device = torch.device("cpu") if device_id is None else torch.device("cuda", device_id)
        self.dtype = dtype or (torch.float16 if self.device.type == "cuda" else torch.float32)
        if self.dtype not in (torch.float16, torch.float32):
            raise TypeError(f"output dtype must be float16 or float32, not {self.dtype}")
        size = images.shape[1]
        augment.check(size)
        pad, cutout, jitter = augment.crop_pad, augment.cutout, augment.jitter
        if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
            raise ValueError(f"mean and std need 3 channels and std > 0, not {mean}, {std}")
        if batch_size < 1 or prefetch < 1:
            raise ValueError(f"batch_size and prefetch must be >= 1, not {batch_size}, {prefetch}")
        shard_t = torch.arange(len(images)) if shard is None else torch.as_tensor(np.asarray(shard), dtype=torch.long)
        if shard_t.ndim != 1 or len(shard_t) == 0 or shard_t.min() < 0 or shard_t.max() >= len(images):
            raise ValueError(f"shard must be a non-empty 1-D array of indices into {len(images)} images")
        steps = len(shard_t) // batch_size if steps_per_epoch is None else steps_per_epoch
        if steps < 1 or steps * batch_size > len(shard_t):
            raise ValueError(
                f"{max(steps, 1)} steps of {batch_size} need {max(steps, 1) * batch_size} images, "
                f"the shard has {len(shard_t)}"
            )

        self.batch_size, self.steps, self.size = batch_size, steps, size
        self.augment, self.rank, self.params_fn = augment, rank, params_fn
        self.mean, self.std = mean, std
        self.shard_index, self.n_read = data_set_index(shard_t.cpu(), len(images), index, n_read)  # epoch_plan's keys
        # gather the shard first (the shard is 1/world of the set), pad once: every batch is a gather
        shard_t = shard_t.to(images.device)
        self.images = pad_images(images[shard_t].to(self.device), pad, augment.pad_mode)  # contiguous NHWC
        self.labels = labels[shard_t].to(self.device)
        self._host_images = self.images.numpy() if self.device.type == "cpu" else None
        self.set_epoch(seed, 0)
        self._ahead = EpochAhead(self._epoch_plan)
        self._static: tuple[torch.Tensor, torch.Tensor] | None = None
        self._feed_stream = torch.cuda.Stream(self.device) if device_id is not None else None

        backend = "gpu" if device_id is not None else "cpu"
        pipe = Pipeline(
            batch_size=batch_size,
            num_threads=num_threads,
            device_id=device_id,
            prefetch_queue_depth=min(prefetch, steps),
            exec_dynamic=True,
        )  # dynamic executor: outputs stay valid while torch holds them
        with pipe:
            padded = fn.external_source(name="images", device=backend, layout="HWC", dtype=types.UINT8, ndim=3)
            args = {}
            if pad:
                args["crop"] = (size, size)
                args["crop_pos_y"] = fn.external_source(name="crop_y", dtype=types.FLOAT, ndim=0)
                args["crop_pos_x"] = fn.external_source(name="crop_x", dtype=types.FLOAT, ndim=0)
            if augment.flip:
                args["mirror"] = fn.external_source(name="mirror", dtype=types.INT32, ndim=0)
            half = self.dtype == torch.float16
            # DALI 2.4's GPU erase rejects float16 ("Unsupported data type", on an H100): with
            # a cutout, normalize to float32, erase there, and round to float16 last, in one cast
            # (the same single rounding as a float16 normalize: the erased zeros are exact in both);
            # the jitter too works on float32 and rounds once at the end, as the reference does
            late_cast = half and (cutout or jitter)
            out = fn.crop_mirror_normalize(
                padded,
                device=backend,
                mean=[float(m) for m in mean],
                std=[float(s) for s in std],
                dtype=types.FLOAT16 if half and not late_cast else types.FLOAT,
                output_layout="HWC",
                rounding="round",
                **args,
            )  # dy/(2*pad) * 2*pad rounds back to dy
            if jitter:  # a batch of per-image scalars broadcasts over the image; on the pipeline's device
                shift = fn.external_source(name="shift", device=backend, dtype=types.FLOAT, ndim=0)
                scale = fn.external_source(name="scale", device=backend, dtype=types.FLOAT, ndim=0)
                out = (out + shift) * scale
            if cutout:
                anchor = fn.external_source(name="cut_anchor", dtype=types.FLOAT, ndim=1)
                out = fn.erase(
                    out, device=backend, anchor=anchor, shape=[float(cutout)] * 2, axis_names="HW", fill_value=0.0
                )
            if late_cast:
                out = fn.cast(out, device=backend, dtype=types.FLOAT16)
            pipe.set_outputs(out)
        pipe.build()
        self._pipe = pipe
        self._flight = _InFlight(pipe, min(prefetch, steps))

    def plain_images(self, n: int) -> torch.Tensor:
        """The shard's first ``n`` images un-augmented, normalized, fp32, NCHW-shaped (channels-last):
        what a data-dependent init (the whitening conv) reads; the same as TorchLoader's."""
        pad = self.augment.crop_pad
        centre = self.images[:n, pad : pad + self.size, pad : pad + self.size]
        return normalize(centre, self.mean, self.std, torch.float32)

    def prepare(self, seeds: Streams | int, epoch: int) -> None:
        """Draw that epoch's plan now and start its copy to the device (``loader.EpochAhead``)."""
        self._ahead.prepare(as_streams(seeds), epoch)

    def bind_static(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        """Copy every batch into these buffers (the CUDA-graph step's inputs) and yield them.

        ``images``: (B, 3, S, S) channels-last ``dtype``; ``labels``: (B,) int64; both on ``device``.
        """
        want = (self.batch_size, 3, self.size, self.size)
        if (
            tuple(images.shape) != want
            or images.dtype != self.dtype
            or images.device != self.device
            or not images.is_contiguous(memory_format=torch.channels_last)
        ):
            raise ValueError(
                f"static images must be {want} channels-last {self.dtype} on {self.device}, "
                f"not {tuple(images.shape)} {images.dtype} on {images.device} "
                f"with strides {images.stride()}"
            )
        if tuple(labels.shape) != (self.batch_size,) or labels.dtype != torch.int64 or labels.device != self.device:
            raise ValueError(
                f"static labels must be ({self.batch_size},) int64 on {self.device}, "
                f"not {tuple(labels.shape)} {labels.dtype} on {labels.device}"
            )
        self._static = (images, labels)

    def _epoch_plan(self, streams: Streams, epoch: int) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """An epoch's batch order (indices into the shard) and DALI's argument inputs, all batches."""
        n, spec = self.steps * self.batch_size, self.augment
        order, p = epoch_plan(
            streams, self.rank, epoch, n, spec, shard_index=self.shard_index, n_read=self.n_read, size=self.size
        )  # the torch loader's too
        if self.params_fn is not None:
            batches = [self._checked(self.params_fn(epoch, s, self.batch_size)) for s in range(self.steps)]
            p = AugmentParams.concat(batches)
        args = {}
        if spec.crop_pad:
            args["crop_y"] = (p.dy.double() / (2 * spec.crop_pad)).float().numpy()
            args["crop_x"] = (p.dx.double() / (2 * spec.crop_pad)).float().numpy()
        if spec.flip:
            args["mirror"] = p.flip.int().numpy()
        if p.jitter:
            args["shift"] = p.shift.float().numpy()
            args["scale"] = p.scale.float().numpy()
        if spec.cutout:
            args["cut_anchor"] = torch.stack([p.cy, p.cx], 1).float().numpy()
        return to_device(order, self.device), args

    def _checked(self, p: AugmentParams) -> AugmentParams:
        """Pinned parameters as CPU int64, each inside its range (DALI would clamp, not fail); the
        jitter's as CPU float32, present exactly when the loader jitters."""
        jitter, limits = self.augment.jitter, self.augment.ranges(self.size)
        if p.jitter != jitter:
            raise ValueError(
                f"params_fn: shift and scale must be {'given' if jitter else 'None'}: this loader "
                f"{'jitters' if jitter else 'does not jitter'}"
            )
        p = AugmentParams(
            **{name: torch.as_tensor(getattr(p, name)).cpu().long() for name in limits},
            **(
                {"shift": torch.as_tensor(p.shift).cpu().float(), "scale": torch.as_tensor(p.scale).cpu().float()}
                if jitter
                else {}
            ),
        )
        for name in ("shift", "scale") if jitter else ():  # a wrong length would put later feeds out of step
            v = getattr(p, name)
            if v.shape != (self.batch_size,) or not bool(torch.isfinite(v).all()):
                raise ValueError(
                    f"params_fn: {name} must be {self.batch_size} finite values, got shape {tuple(v.shape)}"
                )
        for name, high in limits.items():
            v = getattr(p, name)
            if v.shape != (self.batch_size,) or v.min() < 0 or v.max() > high:
                raise ValueError(
                    f"params_fn: {name} must be {self.batch_size} values in 0..{high}, "
                    f"got shape {tuple(v.shape)} range {v.min().item()}..{v.max().item()}"
                )
        return p

    def quiesce(self) -> None:
        """Finish and release every iteration still scheduled (after an abandoned pass), then wait
        for the device: DALI's threads issue no CUDA calls while a graph is being captured."""
        cuda = self._feed_stream is not None
        self._flight.drain(torch.cuda.current_stream(self.device) if cuda else None)
        if cuda:
            torch.cuda.synchronize(self.device)

    def __iter__(self):
        cuda = self._feed_stream is not None
        stream = torch.cuda.current_stream(self.device) if cuda else None
        self._flight.drain(stream)  # a pass abandoned mid-epoch (warm-up) left batches in flight
        order, args = self._ahead.take(self.streams, self.epoch)
        labels = self.labels[order]
        b = self.batch_size
        if cuda:
            self._feed_stream.wait_stream(stream)  # order was made on the compute stream
            order.record_stream(self._feed_stream)

        def feed(step: int) -> None:
            lo, hi = step * b, (step + 1) * b
            if cuda:
                with torch.cuda.stream(self._feed_stream):
                    batch = self.images.index_select(0, order[lo:hi])
                self._pipe.feed_input("images", batch, cuda_stream=self._feed_stream)
            else:
                self._pipe.feed_input("images", self._host_images[order[lo:hi].numpy()])
            for name, values in args.items():
                self._pipe.feed_input(name, values[lo:hi])

        for step, (out,) in enumerate(self._flight.run(self.steps, feed, stream)):
            x = torch.from_dlpack(out.as_tensor()).permute(0, 3, 1, 2)  # NHWC memory, NCHW shape
            y = labels[step * b : (step + 1) * b]
            if self._static is not None:
                sx, sy = self._static
                sx.copy_(x)  # same strides on both sides: one flat device-to-device copy
                sy.copy_(y)
                x, y = sx, sy
            yield x, y


def decode_jpegs(
    encoded: Sequence[bytes],
    device: torch.device | str = "cpu",
    *,
    size: int = 32,
    batch_size: int = DECODE_BATCH,
    num_threads: int = 2,
) -> torch.Tensor:
    """Decode JPEG byte strings once into resident uint8 (N, size, size, 3) RGB on ``device``.

    On CUDA nvJPEG decodes (DALI device "mixed", libjpeg-turbo's chroma upsampling so it agrees
    with the CPU decoders); on CPU libjpeg-turbo via DALI's "cpu" decoder. Raises
    ``JpegDecodeError`` naming the first bad image.
    """
    Pipeline, fn, types = _dali()
    device = torch.device(device)
    device_id = _device_id(device)
    arrays = []
    for i, e in enumerate(encoded):
        if not isinstance(e, (bytes, bytearray, memoryview)):
            raise TypeError(f"encoded[{i}] must be bytes, not {type(e).__name__}")
        if len(e) < 4 or bytes(e[:2]) != b"\xff\xd8":
            raise JpegDecodeError(f"encoded[{i}] is not JPEG data (no start-of-image marker, {len(e)} bytes)")
        arrays.append(np.frombuffer(e, dtype=np.uint8))
    n = len(arrays)
    out = torch.empty((n, size, size, 3), dtype=torch.uint8, device=device)
    if n == 0:
        return out
    b = min(batch_size, n)
    steps = -(-n // b)
    with _dali_log_captured():  # a bad JPEG: DALI's own "[ERROR] [jpeg_parser]" line is not shown
        return _decode_arrays(arrays, encoded, out, Pipeline, fn, types, device, device_id, size, b, steps, num_threads)


# One record of DALI's (nvImageCodec's) own log on stderr: "[ERROR] [jpeg_parser] Invalid marker",
# coloured, not always ending in a newline.
_DALI_LOG = re.compile(
    rb"(?:\x1b\[[0-9;]*m)?\[(?:ERROR|WARNING|WARN|INFO|DEBUG)\] ?(?:\x1b\[[0-9;]*m)?"
    rb"\[[\w .:-]+\][^\n\x1b]*\n?"
)
_COLOUR = re.compile(rb"\x1b\[[0-9;]*m")


@contextlib.contextmanager
def _dali_log_captured():
    """Run a decode with file descriptor 2 sent through a pipe: DALI's C++ code logs a bad JPEG there
    itself, before the error that ``decode_jpegs`` turns into one line. A thread forwards every
    other line to stderr as it arrives (so a crash inside the decode still shows its message: an
    abort's or the driver's text never waits in a buffer) and holds back DALI's own log records;
    afterwards they are written too, unless the decode failed (the one-line error carries their
    cause). Where fd 2 cannot be redirected, nothing is captured."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)
    except (OSError, ValueError, AttributeError):
        yield
        return
    held: list[bytes] = []

    def forward():
        pending = b""
        while True:
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                _route(line + b"\n", held, saved)
        if pending:
            _route(pending, held, saved)

    thread = threading.Thread(target=forward, name="fastcifar-dali-stderr", daemon=True)
    thread.start()
    failed = True
    try:
        yield
        failed = False
    finally:
        os.dup2(saved, 2)  # first: stderr is whole again (and the pipe's last writer gone) whatever happens below
        thread.join(timeout=10)
        os.close(read_end)
        if not failed and held:
            os.write(saved, b"".join(held))
        os.close(saved)


def _route(line: bytes, held: list, stderr_fd: int) -> None:
    """One line from the decode's stderr: DALI's own log record is held back, anything else goes out."""
    records = _DALI_LOG.findall(line)
    if not records:
        os.write(stderr_fd, line)
        return
    held.extend(records)
    rest = _DALI_LOG.sub(b"", line)
    if _COLOUR.sub(b"", rest).strip():
        os.write(stderr_fd, rest)


def _decode_arrays(arrays, encoded, out, Pipeline, fn, types, device, device_id, size, b, steps, num_threads):
    n = len(arrays)
    pipe = Pipeline(
        batch_size=b,
        num_threads=num_threads,
        device_id=device_id,
        prefetch_queue_depth=min(2, steps),
        exec_dynamic=True,
    )
    with pipe:
        data = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
        extra = {"jpeg_fancy_upsampling": True} if device_id is not None else {}
        pipe.set_outputs(
            fn.decoders.image(data, device="mixed" if device_id is not None else "cpu", output_type=types.RGB, **extra)
        )
    pipe.build()
    stream = torch.cuda.current_stream(device) if device_id is not None else None
    batches = _InFlight(pipe, min(2, steps)).run(
        steps, lambda s: pipe.feed_input("encoded", arrays[s * b : (s + 1) * b]), stream
    )
    for step in range(steps):
        lo = step * b
        try:
            (images,) = next(batches)
        except RuntimeError as exc:
            raise JpegDecodeError(_locate_failure(encoded, lo, min(lo + 2 * b, n), exc)) from None
        for i, shape in enumerate(images.shape()):
            if tuple(shape) != (size, size, 3):
                raise JpegDecodeError(
                    f"encoded[{lo + i}] decodes to {'x'.join(map(str, shape))}, expected {size}x{size}x3"
                )
        out[lo : lo + len(images)].copy_(torch.from_dlpack(images.as_tensor()))
    return out


def _locate_failure(encoded: Sequence[bytes], lo: int, hi: int, exc: Exception) -> str:
    """One line naming the first image in [lo, hi) that PIL cannot decode either, with DALI's cause."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    cause = next((ln for ln in lines if "failure" in ln.lower() or "error:" in ln.lower()), lines[-1] if lines else "")
    try:
        from PIL import Image

        for i in range(lo, hi):
            try:
                Image.open(io.BytesIO(encoded[i])).load()
            except Exception:
                return f"encoded[{i}] is a corrupt JPEG (DALI: {cause})"
    except ImportError:
        pass
    return f"a JPEG among encoded[{lo}:{hi}] could not be decoded (DALI: {cause})"


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def jpeg_size(raw) -> tuple[int, int] | None:
    """(width, height) from a JPEG's frame header, without decoding; None if none is found. A few
    marker segments are skipped (APPn, DQT): microseconds per image."""
    data = bytes(raw[:65536]) if len(raw) > 65536 else bytes(raw)
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # no length
            i += 2
            continue
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        if marker in _SOF:
            if i + 9 > n:
                return None
            return int.from_bytes(data[i + 7 : i + 9], "big"), int.from_bytes(data[i + 5 : i + 7], "big")
        if marker == 0xDA or length < 2:  # scan data before any frame header: not a JPEG we read
            return None
        i += 2 + length
    return None


def dali_decoder(device: torch.device | str):
    """A batch decoder for ``fastcifar.data.load_dataset``: DALI decodes an image folder's JPEGs
    (nvJPEG on the GPU, device "mixed"; libjpeg-turbo on the CPU) when no cache holds them. The
    arrays come back to the host once, for the cache; the loader then keeps its shard on the device.
    It declines (returns None, and PIL decodes) anything that is not all JPEG, not all 32x32 by
    its header, or fails to decode, so PIL's error (or its header check) names the bad file."""

    def decode(raws: list, wheres: list):
        if not raws or not all(bytes(r[:2]) == b"\xff\xd8" for r in raws):
            return None
        if not all(jpeg_size(r) == (32, 32) for r in raws):  # by the header: a 20000x20000 JPEG is never decoded
            return None
        try:
            return decode_jpegs(raws, device).cpu().numpy()
        except JpegDecodeError:
            return None

    decode.name = f"dali-{torch.device(device).type}"  # the cache key's decoder: nvJPEG and libjpeg-turbo differ
    return decode
