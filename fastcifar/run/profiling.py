"""NVTX ranges and a profiler capture window for the training step, both free when off.

``markers(enabled)`` returns the (push, pop) pair the step calls around its phases: NVTX's own
functions when asked for (``--nvtx``) and CUDA is there, else a function that does nothing (one
Python call, no CUDA call, nothing recorded). ``StepWindow`` starts and stops the CUDA profiler
(``cudaProfilerStart/Stop``, which ``nsys --capture-range=cudaProfilerApi`` waits for) at two
step boundaries of the first run, and calls the callbacks a script registered with ``on_step``
(``scripts/profile_torch.py`` passes ``torch.profiler``'s ``step``) at every boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from fastcifar.core.config import parse_window
from fastcifar.run.component import Component

PHASES = ("data", "forward", "backward", "comm", "optimizer")  # the range names the trainer uses

_callbacks: list[Callable[[], None]] = []


def _nothing(*args) -> None:
    return None


def markers(enabled: bool) -> tuple[Callable[[str], object], Callable[[], object]]:
    """(push, pop) for NVTX ranges; no-ops unless ``enabled`` and CUDA is available."""
    if enabled and torch.cuda.is_available():
        return torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    return _nothing, _nothing


def ranged(iterable: Iterable, name: str, push, pop) -> Iterable:
    """``iterable`` with each ``next()`` inside a ``name`` range; itself when the markers are off."""
    if push is _nothing:
        return iterable
    return _ranged(iter(iterable), name, push, pop)


def _ranged(it: Iterator, name: str, push, pop) -> Iterator:
    while True:
        push(name)
        try:
            item = next(it)
        except StopIteration:
            pop()
            return
        pop()
        yield item


def on_step(callback: Callable[[], None]) -> Callable[[], None]:
    """Register ``callback`` to run at every step boundary of every run; returns it (for removal)."""
    _callbacks.append(callback)
    return callback


def remove_step_callback(callback: Callable[[], None]) -> None:
    _callbacks.remove(callback)


class StepWindow(Component):
    """Profiler start at step boundary A (A timed steps done) and stop at boundary B, for 'A:B'.

    The trainer makes one per run (the spec only for run 1), before its first timed step, and
    calls ``boundary()`` after every timed step and ``close()`` at the run's end. Boundaries count
    timed steps across epochs; a window that spans an epoch's end captures its evaluation too.
    """

    def __init__(self, spec: str = "", start: Callable[[], None] | None = None, stop: Callable[[], None] | None = None):
        self.window = parse_window(spec)
        cuda = torch.cuda.is_available()  # without CUDA there is no profiler to start: the window does nothing
        self._start = start or (torch.cuda.profiler.start if cuda else _nothing)
        self._stop = stop or (torch.cuda.profiler.stop if cuda else _nothing)
        self.done, self.active = 0, False
        self._check()

    def _check(self) -> None:
        if self.window is None:
            return
        if self.done == self.window[0] and not self.active:
            self._start()
            self.active = True
        elif self.done == self.window[1] and self.active:
            self._stop()
            self.active = False

    def boundary(self) -> None:
        self.done += 1
        self._check()
        for callback in list(_callbacks):
            callback()

    def close(self) -> None:
        if self.active:
            self._stop()
            self.active = False

    def after_step(self) -> None:  # the run's component: a boundary after every timed step
        self.boundary()

    def finish(self, result) -> None:
        self.close()


def graphs_note(nvtx: bool, use_graphs: bool) -> str:
    """What --nvtx shows when the step is one captured graph ("" when it does not apply)."""
    if nvtx and use_graphs:
        return (
            "note: with CUDA graphs --nvtx marks each step as one range; --cuda-graphs off "
            "shows its forward, backward, comm and optimizer phases"
        )
    return ""
