"""What the trainer calls: the Compression a config names, whether it can be captured, its log.

compression = compress.from_config(cfg, ctx, seed)          # None for --compress none
buckets = comm.GradBuckets(model.parameters(), cfg.bucket_mb, compression=compression)
...
compress.log_stats(buckets.compression, log, run)            # a line, and summary.json's "compression"
"""

from __future__ import annotations

from fastcifar.parallel.compress.compressors import make
from fastcifar.parallel.compress.engine import Compression


def from_config(cfg, ctx, seed: int) -> Compression | None:
    """The Compression for ``--compress`` (None for ``none`` or a single process: nothing is sent).
    ``seed``: the run's seed; every rank gets the same, the rank picks its own RNG stream."""
    if cfg.compress == "none" or not ctx.distributed:
        return None
    compressor = make(
        cfg.compress,
        ratio=cfg.compress_ratio,
        threshold=cfg.compress_threshold,
        levels=cfg.qsgd_levels,
        rank=cfg.powersgd_rank,
        randomk_unbiased=cfg.randomk_unbiased,
        terngrad_clip=cfg.terngrad_clip,
    )
    return Compression(
        compressor,
        scope=cfg.compress_scope,
        error_feedback=cfg.error_feedback,
        warmup_steps=cfg.compress_warmup_steps,
        transport=cfg.compress_transport,
        seed=seed,
    )


def why_not_capturable(cfg) -> str:
    """Why this compression setting cannot be captured as a CUDA graph ("" when it can): Threshold's
    payload size is read back to the host every step, and the dense warm-up switches the path on a
    host step count that graph replays do not advance."""
    if cfg.compress == "threshold":
        return "--compress threshold sends a payload whose size changes every step"
    if cfg.compress != "none" and cfg.compress_warmup_steps > 0:
        return "--compress-warmup-steps switches from dense to compressed on a host step count"
    return ""


def log_stats(compression: Compression | None, log, run: int) -> dict | None:
    """One line per run in the log and a record in summary.json's "compression" list."""
    if compression is None:
        return None
    stats = compression.summary()  # steps from the device counter: graph replays count
    record = {"run": run, "method": compression.describe(), **stats}
    log.meta.setdefault("compression", []).append(record)
    ms = stats["compress_ms_per_step"]
    log.line(
        f"run {run}: compressed communication: {stats['bytes_per_step'] / 2**20:.4f} MiB sent per step "
        f"per rank vs {stats['dense_bytes_per_step'] / 2**20:.4f} MiB dense (ratio {stats['ratio']:.1f}x), "
        f"compress {'n/a' if ms is None else f'{ms:.2f} ms'} per step (host), "
        f"{stats['compressed_steps']}/{stats['steps']} steps compressed"
    )
    return record
