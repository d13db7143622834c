"""Compressed gradient communication for the bucketed all-reduce.

The field's split (GRACE, DDP communication hooks): a compressor (``compressors``: compress ->
payload + context, decompress), an error-feedback memory (``memory``), and the transport the
payload needs (``engine``: all-reduce when payloads sum, all-gather when each rank's indices or
scales differ, or the seed's dense all-reduce). ``fastcifar.parallel.comm.GradBuckets`` calls
``Compression.launch`` per bucket; the trainer only names the method (``from_config``).
"""

from __future__ import annotations

from fastcifar.parallel.compress.compressors import METHODS, Compressor, make
from fastcifar.parallel.compress.engine import SCOPES, TRANSPORTS, Compression, pack, unpack
from fastcifar.parallel.compress.trainer import from_config, log_stats, why_not_capturable

__all__ = [
    "METHODS",
    "SCOPES",
    "TRANSPORTS",
    "Compression",
    "Compressor",
    "from_config",
    "log_stats",
    "make",
    "pack",
    "unpack",
    "why_not_capturable",
]
