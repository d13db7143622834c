"""Progress bars for the long stretches (decoding, warm-up and capture, each epoch's steps and evaluation).

Only rank 0 draws, only on a terminal (stderr is a TTY) and not with --quiet: logs, pipes and
CI output stay exactly the fixed-width lines of ``fastcifar.run.report``. Bars go to stderr and
vanish when done (``leave=False``), so the terminal keeps the epoch lines. tqdm redraws at most
every 0.1 s (``mininterval``), so a bar costs a few microseconds per step, not a device sync.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator

import numpy as np
from tqdm import tqdm


class Progress:
    def __init__(self, enabled: bool, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = bool(enabled) and self.stream.isatty()

    @classmethod
    def for_rank(cls, is_main: bool, quiet: bool) -> Progress:
        return cls(is_main and not quiet)

    def steps(self, iterable: Iterable, total: int, desc: str, unit: str = "step") -> Iterable:
        """``iterable`` itself when off; else the same items under a bar of ``total`` steps (``unit``s)."""
        if not self.enabled:
            return iterable
        return self._bar(iterable, total=total, desc=desc, unit=unit)

    def counter(self, total: int, desc: str, unit: str = "img"):
        """A bar to ``update(n)`` by hand, or an object whose ``update`` does nothing; close it."""
        if not self.enabled:
            return _Silent()
        return self._bar(total=total, desc=desc, unit=unit, unit_scale=True)

    def _bar(self, iterable=None, **kw) -> tqdm:
        return tqdm(iterable, leave=False, file=self.stream, dynamic_ncols=True, mininterval=0.1, **kw)

    @contextlib.contextmanager
    def stage(self, desc: str) -> Iterator[None]:
        """One status line while a step of unknown length runs (warm-up and graph capture)."""
        if not self.enabled:
            yield
            return
        bar = tqdm(total=None, desc=desc, bar_format="{desc}... {elapsed}", leave=False, file=self.stream)
        try:
            yield
        finally:
            bar.close()


DECODE_CHUNK = 10_000  # images per decoder call under a bar: 6 updates for 60,000; each call builds a DALI pipeline


def chunked_decoder(decode: Callable | None, progress: Progress) -> Callable:
    """A ``fastcifar.data`` batch decoder that decodes in chunks under a bar: ``decode`` (DALI)
    per chunk, and PIL for any chunk it declines or when it is None, exactly as the data layer
    would for the whole split (a bad file is still named by PIL)."""
    from fastcifar.data.folder import decode_with_pil, decoder_name

    def run(raws: list, wheres: list):
        bar = progress.counter(len(raws), "decoding")
        try:
            parts = []
            for lo in range(0, len(raws), DECODE_CHUNK):
                chunk, names = raws[lo : lo + DECODE_CHUNK], wheres[lo : lo + DECODE_CHUNK]
                images = decode(chunk, names) if decode is not None else None
                parts.append(decode_with_pil(chunk, names) if images is None else images)
                bar.update(len(chunk))
            return np.concatenate(parts) if parts else None
        finally:
            bar.close()

    run.name = decoder_name(decode)  # the cache key's decoder stays DALI's: rank 0 and the others share one cache
    return run


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass
