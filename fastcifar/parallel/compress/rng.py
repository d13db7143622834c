"""Counter-based random numbers for the compressors: graph-safe, per rank or shared by all ranks.

A uniform number is a hash of (seed, stream, chunk key, step, element index). The step is a device
tensor that ``advance()`` increments with a device op, so a captured CUDA graph draws fresh numbers
at every replay without a generator whose state the graph would have to track; nothing is read
back to the host. ``stream`` separates ranks (each rank its own stream: independent draws) from
the shared stream (the same numbers on every rank: RandomK's common coordinates, PowerSGD's first
Q). The hash is two rounds of a 32-bit integer mixer (multiplier 0x45d9f3b, good avalanche), done
in int64 with the products kept under 2^59, so it runs the same on the CPU and the GPU.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MIX = 0x45D9F3B  # < 2^27: a 32-bit value times this stays below 2^59, no int64 overflow
GOLDEN = 0x9E3779B1  # spreads consecutive steps and keys over the 32-bit space
SHARED_STREAM = 2**20  # any stream number no rank uses


def _mix(x):
    """The mixer on an int64 tensor or a Python int (operators only: the same numbers on both)."""
    for _ in range(2):
        x = (((x >> 16) ^ x) * MIX) & MASK32
    return (x >> 16) ^ x


class CounterRNG:
    def __init__(self, seed: int, stream: int, device: torch.device | str = "cpu"):
        self.seed, self.stream = seed, stream
        self.step = torch.zeros((), dtype=torch.int64, device=device)

    def uniform(self, n: int, key: int = 0) -> torch.Tensor:
        """n float32 numbers in [0, 1) (24 random bits each) for chunk ``key`` at the current step."""
        base = _mix((self.seed * GOLDEN + self.stream * MIX + key * 0x632BE5AB) & MASK32)
        idx = torch.arange(n, dtype=torch.int64, device=self.step.device)
        x = _mix((idx + base + self.step * GOLDEN) & MASK32)
        return (x >> 8).to(torch.float32) * (1.0 / 2**24)

    def normal(self, n: int, key: int = 0) -> torch.Tensor:
        """n standard normal numbers (Box-Muller on two uniform draws)."""
        u1 = self.uniform(n, 2 * key + 1).clamp_min(2**-24)
        u2 = self.uniform(n, 2 * key + 2)
        return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * torch.pi * u2)

    def advance(self) -> None:
        self.step.add_(1)

    def reset(self) -> None:
        self.step.zero_()
