"""What a run may switch on, as one small interface the trainer calls at fixed points.

A whitening conv's init and bias freeze, the recipe's lookahead, sparse training, checkpoints, the
divergence guard, the profiler window, the progress watchdog, the gradient sync's clean-up and the
model file are each a ``Component``: the trainer builds the run's list once
(``run.components.for_run``) and calls every member at each point, in list order. A component
overrides what it needs; every method defaults to nothing, so the trainer never asks what a
component is or whether an option is on.

The points, in a run's order, and what the clock is doing there:

- ``start(result)``: off the clock, after warm-up and capture, before the first epoch; returns the
  epoch to start at (a resumed run's), or None to leave it;
- ``epoch_start(epoch)``: on the clock, before the epoch's first step;
- ``after_step()``: on the clock, after each step is queued;
- ``epoch_end(epoch)``: on the clock, after the last step is queued, before the clock stops;
- ``epoch_done(epoch, record)``: off the clock, after the epoch's evaluation and log line;
- ``finish(result)``: after the last epoch, with the run's result filled in.
"""

from __future__ import annotations


class Component:
    def start(self, result) -> int | None:
        return None

    def epoch_start(self, epoch: int) -> None:
        pass

    def after_step(self) -> None:
        pass

    def epoch_end(self, epoch: int) -> None:
        pass

    def epoch_done(self, epoch: int, record) -> None:
        pass

    def finish(self, result) -> None:
        pass


class Components:
    """A run's components, called together; ``after_step`` (every step) calls only those that
    override it, so the steps' Python overhead does not grow with what is switched off."""

    def __init__(self, members: list[Component]):
        self.members = members
        self._after_step = [c.after_step for c in members if type(c).after_step is not Component.after_step]

    def start(self, result) -> int:
        """The epoch to start at: 0, or the last answer a component gave (a resume)."""
        start = 0
        for c in self.members:
            answer = c.start(result)
            if answer is not None:
                start = answer
        return start

    def epoch_start(self, epoch: int) -> None:
        for c in self.members:
            c.epoch_start(epoch)

    def after_step(self) -> None:
        for call in self._after_step:
            call()

    def epoch_end(self, epoch: int) -> None:
        for c in self.members:
            c.epoch_end(epoch)

    def epoch_done(self, epoch: int, record) -> None:
        for c in self.members:
            c.epoch_done(epoch, record)

    def finish(self, result) -> None:
        for c in self.members:
            c.finish(result)
