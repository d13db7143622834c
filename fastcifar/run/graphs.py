"""One training step, and one evaluation batch, captured as CUDA graphs and replayed.

At CIFAR sizes a ResNet-9 step is a few hundred small kernels (about 35 per conv block forward
and backward, plus the optimizer's foreach launches); launching them from Python costs more than
running many of them. A CUDA graph replays the whole step with one launch.

What makes one graph serve a whole run:
- inputs live in static buffers (``StaticBatch``) that the loader fills before each replay, with
  one device-to-device copy;
- the learning-rate schedule is a table on the device, and the step reads its entry through a
  step counter that is itself a device tensor incremented inside the graph (``run.schedule.DeviceSchedule``),
  so no host value is baked into the capture;
- parameters, gradients, optimizer state and gradient buckets exist before capture (warm-up
  iterations create the gradients) and are only ever updated in place afterwards; restoring the
  initial state after warm-up copies into the same storage.
- evaluation pads the last partial batch and masks the padding out of the counts, so its shape
  never changes.

Without CUDA everything here except the capture itself runs eagerly, and the CPU tests use it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from fastcifar.core.config import ConfigError
from fastcifar.ops.tta import share_views, tta_logits, views_logits


def resolve(setting: str, device: torch.device, blocker: tuple[str, str] = ("", "")) -> tuple[bool, str]:
    """Whether to capture, and a note when ``auto`` turned capture off for a reason worth logging.
    ``auto`` means on for CUDA; ``on`` where it cannot work is refused. ``blocker``: why the run's
    gradient sync cannot be captured, as (the refusal of ``on``, the note for ``auto``)
    (``parallel.sync.capture_blocker``; empty when it can)."""
    if setting not in ("auto", "on", "off"):
        raise ConfigError(f"--cuda-graphs must be auto, on or off, not {setting!r}")
    if device.type != "cuda":
        if setting == "on":
            raise ConfigError("--cuda-graphs on needs a CUDA device; this run is on the CPU")
        return False, ""
    refusal, note = blocker
    if refusal and setting != "off":
        if setting == "on":
            raise ConfigError(refusal)
        return False, note
    return setting != "off", ""


class StaticBatch:
    """Fixed input buffers of one step: images (NCHW-shaped, channels-last) and int64 labels.

    ``load`` copies a batch in (one device-to-device copy each). A batch smaller than the buffer
    is padded with zeros and the ``valid`` mask marks its real rows, so evaluation of a last,
    partial batch keeps the captured shape."""

    def __init__(self, batch: int, dtype: torch.dtype, device: torch.device, size: int = 32, channels: int = 3):
        self.images = torch.zeros(batch, channels, size, size, dtype=dtype, device=device).contiguous(
            memory_format=torch.channels_last
        )
        self.labels = torch.zeros(batch, dtype=torch.int64, device=device)
        self.valid = torch.ones(batch, dtype=torch.bool, device=device)
        self._valid_rows = batch  # host copy of valid.sum(): the mask is rewritten only when it changes

    @property
    def capacity(self) -> int:
        return self.labels.shape[0]

    def load(self, images: torch.Tensor, labels: torch.Tensor) -> int:
        n = labels.shape[0]
        if images.shape[1:] != self.images.shape[1:] or images.shape[0] != n:
            raise ValueError(f"batch of shape {tuple(images.shape)} does not fit buffers of {tuple(self.images.shape)}")
        if n > self.capacity:
            raise ValueError(f"batch of {n} images exceeds the static buffer of {self.capacity}")
        if images.data_ptr() == self.images.data_ptr() and n == self.capacity:
            return n  # the loader already wrote into these buffers (DaliLoader.bind_static)
        self.images[:n].copy_(images)
        self.labels[:n].copy_(labels)
        if n < self.capacity:
            self.images[n:].zero_()
            self.labels[n:].zero_()
        if n != self._valid_rows:  # only evaluation's last batch: no mask work on the training step
            self.valid.copy_(torch.arange(self.capacity, device=self.valid.device) < n)
            self._valid_rows = n
        return n


def capture_error_mode() -> str:
    """The CUDA stream-capture mode of this process's captures: ``thread_local`` while an NCCL
    process group exists, ``global`` otherwise.

    NCCL's watchdog thread polls the CUDA events of eagerly issued collectives (the warm-up steps'
    all-reduces, the start-up handshake) with ``cudaEventQuery``, on its own schedule. In ``global``
    mode an unsafe call from any thread while a capture is open invalidates that capture, so a poll
    that lands inside it failed the capture at random (pytorch PRs #104487 and #104555 describe the
    crash). ``thread_local`` checks only the capturing thread, so the polls are harmless. torch
    fixed it on the watchdog's side (#148594: its event queries run thread-local; #160398, first in
    2.9: the start-event query too); the project supports torch >= 2.4, so the capture tolerates the
    polls itself. Captured collectives are never handed to the watchdog (#102542). Without NCCL,
    ``global`` keeps CUDA's strict check on other threads (a DALI thread's CUDA call during a
    capture fails it loudly)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return "thread_local"
    return "global"


def capture(
    body: Callable[[], None], warmup_iters: int, stream: torch.cuda.Stream | None = None
) -> torch.cuda.CUDAGraph:
    """Run ``body`` ``warmup_iters`` times on a side stream (cuDNN autotuning, Triton compilation,
    first gradients and allocator growth happen there, as capture requires), then capture it once
    (in ``capture_error_mode()``).
    ``stream``: warm up and capture on this one (torch's own capture stream when None); graphs that
    backprop through another's captured forward need that forward's stream, where autograd runs."""
    side = stream or torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_iters):
            body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode=capture_error_mode()):
        body()
    return graph


StepFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class _BatchStep:
    """A computation over a ``StaticBatch`` that sums a loss and a count of correct predictions
    into device scalars; run eagerly or, once captured, by replaying its graph."""

    def __init__(self, batch: StaticBatch, capture: bool):
        self.batch, self.capture = batch, capture
        device = batch.labels.device
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None

    def _body(self) -> None:
        raise NotImplementedError

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.batch.load(images, labels)
        self.replay()

    def replay(self) -> None:
        """Run on the batch already loaded."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body()

    def reset(self) -> None:
        self.loss_sum.zero_()
        self.correct.zero_()


class TrainStep(_BatchStep):
    """The training step: ``step_fn(images, labels) -> (summed loss, correct count)``, which
    updates the model in place.

    A graph replays the work its capture saw, so a run whose backward changes shape part-way (the
    `fast` recipe stops backpropagating into its whitening conv once the conv's bias freezes)
    captures each form as a named variant before the clock starts and ``select``s it when the
    change happens; eagerly, ``select`` only records the name."""

    DEFAULT = "default"

    def __init__(self, step_fn: StepFn, batch: StaticBatch, capture: bool):
        super().__init__(batch, capture)
        self.step_fn = step_fn
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.variant = self.DEFAULT

    def _body(self) -> None:
        loss, hits = self.step_fn(self.batch.images, self.batch.labels)
        self.loss_sum.add_(loss)
        self.correct.add_(hits)

    def warm_up_and_capture(self, warmup_iters: int, variant: str = DEFAULT) -> None:
        """Run ``warmup_iters`` steps, then (when capturing) capture one as ``variant``, with the
        model as it is set up now. The caller restores the model's state afterwards; the metrics
        are reset here. The step replays the selected variant (the default until ``select``)."""
        if self.capture:
            self.graphs[variant] = capture(self._body, max(warmup_iters, 2))  # 2: the first step allocates grads
            self.graph = self.graphs.get(self.variant)
        else:
            for _ in range(warmup_iters):
                self._body()
        self.reset()

    def select(self, variant: str) -> None:
        """Replay ``variant`` from the next step on (captured by ``warm_up_and_capture``)."""
        if self.capture and variant not in self.graphs:
            raise RuntimeError(
                f"no captured training step {variant!r} (captured: {', '.join(self.graphs)}): "
                "capture each variant before the clock starts"
            )
        self.variant = variant
        self.graph = self.graphs.get(variant)


class EvalStep(_BatchStep):
    """Evaluation of one padded batch: sums the loss and the correct predictions of the valid
    rows, with test-time augmentation level ``tta`` (``fastcifar.ops.tta``: 0 none, 1 flip, 2 flip
    and 1-pixel shifts) given to the ``tta_share`` of the batch's valid rows least sure of their class."""

    def __init__(self, model: torch.nn.Module, batch: StaticBatch, tta: int, capture: bool, tta_share: float = 1.0):
        super().__init__(batch, capture)
        self.model, self.tta, self.tta_share = model, tta, tta_share
        self.logits: torch.Tensor | None = None  # the last batch's fp32 logits: a captured graph's own output
        self.kept: list[torch.Tensor] | None = None  # ``keep_logits``: each batch's real rows since ``reset``

    @torch.no_grad()
    def _body(self) -> None:
        images, labels, valid = self.batch.images, self.batch.labels, self.batch.valid
        logits = tta_logits(self.model, images, self.tta, self.tta_share, valid)
        loss = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
        self.loss_sum.add_((loss * valid).sum())
        self.correct.add_(((logits.argmax(1) == labels) & valid).sum())
        self.logits = logits  # a reference, no work: each replay rewrites the tensor its capture made

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        rows = self.batch.load(images, labels)
        self.replay()
        if self.kept is not None:  # a copy of the logits the counts above just took, before the next batch
            self.kept.append(self.logits[:rows].clone())

    def keep_logits(self) -> None:
        """From the next evaluation on, keep each batch's logits (``kept``, one tensor per batch in
        the order given): the very values its loss and correct count were summed from."""
        self.kept = []

    def reset(self) -> None:
        super().reset()
        if self.kept is not None:
            self.kept = []

    def prepare(self) -> None:
        """Capture (after two eager warm-up batches on a side stream) when capturing; the
        model must be in eval mode."""
        if self.capture and self.graph is None:
            self.graph = capture(self._body, 2)
        self.reset()

    def run(self, batches, test_set) -> None:
        """Add every batch of ``batches`` (``test_set``'s, in order, maybe under a progress bar)
        to the sums."""
        for images, labels in batches:
            self(images, labels)


class WholeTestEvalStep(EvalStep):
    """``--tta-scope test``: the TTA views go to the ``tta_share`` of the rank's whole test set
    least sure of its class (``ops.tta.share_views``), not of each batch. Two passes, each over
    fixed batches, each its own captured graph: the plain view of every batch into one logits
    table, then the views of the chosen rows, ``batch`` rows at a time, over their plain logits;
    the loss and hits of the table count each image once. Nothing is read back to the host: the
    chosen count, ceil(share x the rank's images), is known there."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch: StaticBatch,
        tta: int,
        capture: bool,
        tta_share: float,
        views_batch: StaticBatch | None = None,
    ):
        super().__init__(model, batch, tta, capture, tta_share)
        # the views pass's own buffers, sized so the chosen rows fill its batches (make_eval_step)
        self.views_batch = batch if views_batch is None else views_batch
        self.views_graph: torch.cuda.CUDAGraph | None = None

    @torch.no_grad()  # captured: no autograd graph kept alive in the pool (about 6 MB an image at fp16)
    def _body(self) -> None:  # the plain pass of one batch; a capture keeps its output tensor
        self.plain = self.model(self.batch.images).float()

    @torch.no_grad()
    def _views_body(self) -> None:
        self.views = views_logits(self.model, self.views_batch.images, self.tta)

    def prepare(self) -> None:
        if self.capture and self.graph is None:
            self.graph = capture(self._body, 2)
            self.views_graph = capture(self._views_body, 2)
        self.reset()

    def replay(self) -> None:
        """One batch of each pass (the run's estimate times this for every batch: an upper bound,
        as only the share's batches take the views)."""
        self._replay(self.graph, self._body)
        self._replay(self.views_graph, self._views_body)

    @staticmethod
    def _replay(graph, body) -> None:
        if graph is not None:
            graph.replay()
        else:
            body()

    @torch.no_grad()
    def run(self, batches, test_set) -> None:
        count = len(test_set.labels)
        if count == 0:
            return
        logits, start = None, 0
        for images, labels in batches:
            rows = self.batch.load(images, labels)
            self._replay(self.graph, self._body)
            if logits is None:
                logits = torch.empty(count, self.plain.shape[1], dtype=torch.float32, device=self.plain.device)
            logits[start : start + rows].copy_(self.plain[:rows])
            start += rows

        def views(rows: torch.Tensor) -> torch.Tensor:
            n = self.views_batch.load(test_set.images.index_select(0, rows), test_set.labels.index_select(0, rows))
            self._replay(self.views_graph, self._views_body)
            return self.views[:n]

        share_views(logits, self.tta_share, self.views_batch.capacity, views)
        labels = test_set.labels
        self.loss_sum.add_(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
        self.correct.add_((logits.argmax(1) == labels).sum())
        if self.kept is not None:  # --save-outputs: the table the counts above were taken from, one tensor
            self.kept.append(logits)


def make_eval_step(
    model: torch.nn.Module,
    batch: StaticBatch,
    tta: int,
    capture: bool,
    tta_share: float = 1.0,
    tta_scope: str = "batch",
    test_rows: int = 0,
) -> EvalStep:
    """The run's evaluation step: ``WholeTestEvalStep`` where ``--tta-scope test`` chooses among
    images (a TTA level and a share below 1), else ``EvalStep`` (a share of 1 gives every image the
    views whatever the scope: the same step). ``test_rows``: the rank's test images, when known:
    the views pass then takes the chosen ceil(share x rows) in as few batches as the evaluation's
    size allows, each as full as it can be (2,500 of 10,000 at batch 1000: three of 834, not three
    of 1000 with 500 rows of padding run through every view)."""
    if tta_scope == "test" and tta and tta_share < 1.0:
        views_batch = None
        chosen = math.ceil(tta_share * test_rows)
        if chosen:
            rows = -(-chosen // -(-chosen // batch.capacity))
            if rows < batch.capacity:
                views_batch = StaticBatch(rows, batch.images.dtype, batch.images.device, batch.images.shape[2])
        return WholeTestEvalStep(model, batch, tta, capture, tta_share, views_batch)
    return EvalStep(model, batch, tta, capture, tta_share)
