"""A run's random draws as separate streams, so that changing one thing changes nothing else.

``--seed`` is the one seed a user must know; run k of ``--runs`` is seeded ``--seed + k - 1`` (the
run seed). From the run seed each stream gets its own 63-bit seed (numpy's ``SeedSequence`` of
the run seed and the stream's number: independent, and the same on every machine):

  init    the network's initial weights (``torch.manual_seed`` right before the model is built)
  order   the order of the training images in each epoch, per rank (``data.loader.epoch_plan``)
  aug     each image's crop, flip, cutout and jitter in each epoch, keyed by its data-set index
  subset  the training subset of ``--subset-fraction`` (``data.subsets``)

``--seed-init``, ``--seed-order``, ``--seed-aug`` and ``--seed-subset`` set one stream each; run k
then uses the value + k - 1, as ``--seed`` does. The draws no stream above decides stay on the run
seed: compressed communication's random choices (``--compress randomk``, ``terngrad``, ``qsgd``)
and ``--sparse-mask random``. docs/experiments.md says what each stream decides.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

STREAMS = ("init", "order", "aug", "subset")
UNSET = -1  # a --seed-<stream> left at this is derived from the run seed
# each stream's number in its SeedSequence: fixed forever, or every derived draw changes
_KEYS = {"init": 1, "order": 2, "aug": 3, "subset": 4}


def derive(seed: int, *keys: int) -> int:
    """A 63-bit seed (torch.manual_seed's range) from ``seed`` and ``keys``, distinct per key tuple."""
    return int(np.random.SeedSequence([seed, *keys]).generate_state(1, dtype=np.uint64)[0] >> 1)


@dataclass(frozen=True)
class Streams:
    """The seeds of one run's random draws: its run seed and one seed per stream."""

    run: int  # --seed + run - 1: what no stream decides (compression, random sparse masks)
    init: int
    order: int
    aug: int
    subset: int

    @classmethod
    def derived(cls, run_seed: int) -> Streams:
        """Every stream derived from ``run_seed`` (no --seed-<stream> given)."""
        return cls(run=run_seed, **{name: derive(run_seed, _KEYS[name]) for name in STREAMS})

    @classmethod
    def for_run(cls, cfg, run_seed: int) -> Streams:
        """The streams of the run seeded ``run_seed`` (``cfg.seed`` + run - 1): each
        ``cfg.seed_<stream>`` given shifted by the same run offset, the others derived."""
        offset = run_seed - cfg.seed
        own = cls.derived(run_seed)
        given = {name: getattr(cfg, f"seed_{name}") for name in STREAMS}
        return cls(
            run=run_seed,
            **{name: getattr(own, name) if seed == UNSET else seed + offset for name, seed in given.items()},
        )

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def as_streams(seeds: Streams | int) -> Streams:
    """``seeds`` itself, or the streams derived from a run seed (a loader driven by one seed)."""
    return seeds if isinstance(seeds, Streams) else Streams.derived(int(seeds))
