"""Lookahead weight averaging (the scheme of hlb-CIFAR10 and airbench), with a cubic ramp.

Every ``every`` optimizer steps the slow copy moves toward the trained weights and then replaces
them:

    slow <- decay * slow + (1 - decay) * fast          fast <- slow

with ``decay = final_decay * (step / total_steps) ** 3``: 0 early on (the slow copy just follows),
``final_decay`` (0.95^5 = 0.774 in the `fast` preset) at the end. It is lookahead, not a shadow EMA:
the trained weights are pulled back at every sync, so evaluation needs no swap: the model holds
the averaged weights after ``finish()``, and within ``every - 1`` steps of them at any epoch end.
Batchnorm running statistics are averaged with the weights (every floating-point entry of the
state dict); integer counters are left alone. Momentum buffers are not touched.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class Lookahead:
    def __init__(self, model: torch.nn.Module, every: int, final_decay: float, total_steps: int):
        if every <= 0 or total_steps <= 0:
            raise ValueError(f"lookahead needs positive every and total_steps, not {every}, {total_steps}")
        if not 0 <= final_decay < 1:
            raise ValueError(f"lookahead decay must lie in [0, 1), not {final_decay}")
        self.every, self.final_decay, self.total_steps = every, final_decay, total_steps
        groups = defaultdict(list)  # one dtype per foreach list
        for t in model.state_dict().values():  # aliases of the parameters and buffers themselves
            if t.is_floating_point():
                groups[(t.device, t.dtype)].append(t)
        self.fast = list(groups.values())
        self.slow = [[t.detach().clone() for t in group] for group in self.fast]
        self.steps = 0

    def decay(self, step: int) -> float:
        return self.final_decay * (min(step, self.total_steps) / self.total_steps) ** 3

    @torch.no_grad()
    def sync(self, decay: float) -> None:
        for fast, slow in zip(self.fast, self.slow):
            torch._foreach_lerp_(slow, fast, 1.0 - decay)
            torch._foreach_copy_(fast, slow)

    def step(self) -> None:
        """Call after every optimizer step."""
        self.steps += 1
        if self.steps % self.every == 0:
            self.sync(self.decay(self.steps))

    def finish(self) -> None:
        """Fold in the steps since the last sync (none are dropped), leaving the averaged weights."""
        if self.steps % self.every:
            self.sync(self.decay(self.steps))

    def state_dict(self) -> dict:
        """Steps taken and the slow copy (on the CPU): what a resumed run needs to continue."""
        return {"steps": self.steps, "slow": [[t.detach().cpu().clone() for t in group] for group in self.slow]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        shapes = [[tuple(t.shape) for t in group] for group in self.slow]
        if [[tuple(t.shape) for t in group] for group in state["slow"]] != shapes:
            raise ValueError("the lookahead state does not fit this model's weights")
        self.steps = int(state["steps"])
        for slow, saved in zip(self.slow, state["slow"]):
            torch._foreach_copy_(slow, [t.to(slow[0].device) for t in saved])
