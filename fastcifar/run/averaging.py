"""Lookahead weight averaging (the scheme of hlb-CIFAR10 and airbench), with a cubic ramp.

Every ``every`` optimizer steps the slow copy moves toward the trained weights and then replaces
them:

    slow <- decay * slow + (1 - decay) * fast          fast <- slow

with ``decay = final_decay * (step / total_steps) ** 3``: near 0 early on (the slow copy just
follows), ``final_decay`` (0.95^5 = 0.774 in the `fast` preset) at the end. It is lookahead, not a
shadow EMA: the trained weights are pulled back at every sync, so evaluation needs no swap.

Two ways to begin and two to end, both the published recipe's and fastcifar's former ones:

- ``begin_step``: the slow copy is taken after this many steps, at a sync step (airbench94: the
  first 5th step of epoch 3, step 145 of 476), and the first sync is ``every`` steps later;
  0 takes it at construction (fastcifar's former choice: the first sync at step ``every``);
- ``reset()``: the trained weights are replaced by the slow copy (decay 1: the steps since the
  last sync are dropped), which airbench94 does at every epoch end once the copy exists;
  ``finish()`` instead folds those steps in with one more sync (fastcifar's former end).

Batchnorm running statistics are averaged with the weights (every floating-point entry of the
state dict); integer counters are left alone. Momentum buffers are not touched.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class Lookahead:
    def __init__(self, model: torch.nn.Module, every: int, final_decay: float, total_steps: int, begin_step: int = 0):
        if every <= 0 or total_steps <= 0:
            raise ValueError(f"lookahead needs positive every and total_steps, not {every}, {total_steps}")
        if not 0 <= final_decay < 1:
            raise ValueError(f"lookahead decay must lie in [0, 1), not {final_decay}")
        if begin_step < 0 or begin_step % every:
            raise ValueError(f"lookahead begins at a multiple of every ({every}), not {begin_step}")
        self.every, self.final_decay, self.total_steps = every, final_decay, total_steps
        self.begin_step = begin_step
        groups = defaultdict(list)  # one dtype per foreach list
        for t in model.state_dict().values():  # aliases of the parameters and buffers themselves
            if t.is_floating_point():
                groups[(t.device, t.dtype)].append(t)
        self.fast = list(groups.values())
        self.slow: list[list[torch.Tensor]] | None = None
        self.steps = 0
        if begin_step == 0:
            self._snapshot()

    def _snapshot(self) -> None:
        self.slow = [[t.detach().clone() for t in group] for group in self.fast]

    def decay(self, step: int) -> float:
        return self.final_decay * (min(step, self.total_steps) / self.total_steps) ** 3

    @torch.no_grad()
    def sync(self, decay: float) -> None:
        for fast, slow in zip(self.fast, self.slow, strict=True):
            torch._foreach_lerp_(slow, fast, 1.0 - decay)
            torch._foreach_copy_(fast, slow)

    def step(self) -> None:
        """Call after every optimizer step."""
        self.steps += 1
        if self.steps % self.every:
            return
        if self.slow is None:
            if self.steps >= self.begin_step:
                self._snapshot()
            return
        self.sync(self.decay(self.steps))

    def reset(self) -> None:
        """Trained weights <- the slow copy (no-op before it exists)."""
        if self.slow is not None:
            self.sync(1.0)

    def finish(self) -> None:
        """Fold in the steps since the last sync (none are dropped), leaving the averaged weights."""
        if self.slow is not None and self.steps % self.every:
            self.sync(self.decay(self.steps))

    def state_dict(self) -> dict:
        """Steps taken and the slow copy (on the CPU): what a resumed run needs to continue."""
        slow = None if self.slow is None else [[t.detach().cpu().clone() for t in group] for group in self.slow]
        return {"steps": self.steps, "slow": slow}  # slow None: saved before begin_step

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        if state["slow"] is None:  # saved before begin_step: the slow copy is still to be taken
            self.slow = None
            return
        shapes = [[tuple(t.shape) for t in group] for group in self.fast]
        if [[tuple(t.shape) for t in group] for group in state["slow"]] != shapes:
            raise ValueError("the lookahead state does not fit this model's weights")
        if self.slow is None:
            self._snapshot()
        for slow, saved in zip(self.slow, state["slow"], strict=True):
            torch._foreach_copy_(slow, [t.to(slow[0].device) for t in saved])
