"""Compressors against plain references, in one process: exact selection, unbiasedness and the
variance the formulas give, error feedback's conservation, the RNG, packing, config checks."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.distributed as dist

from fastcifar.core.config import Config, ConfigError, from_preset, validate
from fastcifar.models.alexnet import AlexNet
from fastcifar.parallel.comm import GradBuckets
from fastcifar.parallel.compress import Compression, engine, log_stats, make, pack, unpack
from fastcifar.parallel.compress.compressors import PowerSGD, _orthonormalize
from fastcifar.parallel.compress.memory import ErrorFeedback
from fastcifar.parallel.compress.rng import MASK32, SHARED_STREAM, CounterRNG, _mix

DRAWS = 2000


def vector(d=64, seed=0):
    return torch.randn(d, generator=torch.Generator().manual_seed(seed))


def roundtrip(comp, x, rng, key=0):
    payload, ctx = comp.compress(x.clone(), 1, rng, rng, key=key)
    return comp.decompress(payload, ctx), payload


def test_topk_selects_exactly_the_largest_magnitudes():
    x = vector(101)
    for ratio in (0.01, 0.1, 0.5, 1.0):
        out, (values, idx) = roundtrip(make("topk", ratio=ratio), x, CounterRNG(0, 0))
        k = math.ceil(ratio * 101)
        assert values.numel() == k and idx.dtype == torch.int32
        expected = set(x.abs().argsort(descending=True)[:k].tolist())
        assert set(idx.tolist()) == expected, ratio
        reference = torch.zeros_like(x)
        reference[list(expected)] = x[list(expected)]
        assert torch.equal(out, reference)


def test_threshold_keeps_exactly_the_coordinates_at_or_above_v():
    x = vector(200)
    out, (values, idx) = roundtrip(make("threshold", threshold=0.7), x, CounterRNG(0, 0))
    assert torch.equal(out, torch.where(x.abs() >= 0.7, x, torch.zeros_like(x)))
    out, (values, idx) = roundtrip(make("threshold", threshold=1e9), x, CounterRNG(0, 0))
    assert values.numel() == 0 and out.abs().sum() == 0


# the compressors of the gather transport (per-rank indices or scales)
GATHER_METHODS = [
    ("topk", {"ratio": 0.1}),
    ("threshold", {"threshold": 0.7}),
    ("randomk", {"ratio": 0.2, "randomk_shared": False}),
    ("terngrad", {}),
    ("qsgd", {"levels": 4}),
]


@pytest.mark.parametrize("method, options", GATHER_METHODS)
def test_accumulate_adds_the_decompressed_payload_over_n(method, options):
    """The gather transport's running mean: accumulate over 3 ranks' payloads, in rank order, is
    the sum of decompress(payload) / 3, bit for bit (sparse payloads write their own coordinates only)."""
    comp, n = make(method, **options), 3
    out, ref = torch.zeros(200), torch.zeros(200)
    for rank in range(n):
        payload, ctx = comp.compress(vector(200, seed=rank), n, CounterRNG(0, rank), CounterRNG(0, SHARED_STREAM))
        comp.accumulate(out, payload, ctx, n)
        ref += comp.decompress(payload, ctx) / n
    assert torch.equal(out, ref) and ref.abs().sum() > 0


@pytest.mark.parametrize("method, options", GATHER_METHODS)
def test_residual_from_the_payload_is_compensated_minus_decompressed(method, options):
    """Error feedback's residual taken off at the payload's own coordinates (the gather transport's
    path) has the bits of compensated - decompress(payload), signed zeros included."""
    comp = make(method, **options)
    g = vector(200, seed=5)
    g[::7] = -0.0  # -0 - 0 must stay -0, as torch.sub leaves it
    payload, ctx = comp.compress(g, 3, CounterRNG(0, 1), CounterRNG(0, SHARED_STREAM))
    sparse, dense = ErrorFeedback(), ErrorFeedback()
    for memory in (sparse, dense):
        memory.compensate(0, torch.zeros(200))
    sparse.update_from_payload(0, g, comp, payload, ctx)
    dense.update(0, g, comp.decompress(payload, ctx))
    got, want = sparse.residual[0], dense.residual[0]
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    assert not torch.equal(want, g), "nothing was sent: the comparison would prove nothing"


def draws(comp, x, shared=False, n=DRAWS):
    rng = CounterRNG(3, SHARED_STREAM if shared else 1)
    out = []
    for _ in range(n):
        out.append(roundtrip(comp, x, rng)[0])
        rng.advance()
    return torch.stack(out)


@pytest.mark.parametrize("method", ["terngrad", "qsgd", "randomk"])
def test_unbiased_with_the_variance_of_the_formula(method):
    x = vector(48, seed=1)
    d = x.numel()
    if method == "terngrad":
        comp = make("terngrad")
        s = x.abs().max()
        var = s * x.abs() - x**2
    elif method == "qsgd":
        comp = make("qsgd", levels=4)
        norm = x.norm()
        r = 4 * x.abs() / norm
        p = r - r.floor()
        var = (norm / 4) ** 2 * p * (1 - p)
    else:
        comp = make("randomk", ratio=0.25, randomk_unbiased=True)
        k = math.ceil(0.25 * d)
        var = x**2 * (d / k - 1)
    samples = draws(comp, x)
    mean, emp_var = samples.mean(0), samples.var(0)
    # the mean of 2000 draws is within 5 standard errors of x, coordinate by coordinate
    assert torch.all((mean - x).abs() <= 5 * (var / DRAWS).sqrt() + 1e-6), (mean - x).abs().max()
    # the variance matches the formula in total (within 10%) and where it is large (within 25%)
    assert emp_var.sum() == pytest.approx(var.sum().item(), rel=0.1)
    big = var > 0.1 * var.max()
    assert torch.allclose(emp_var[big], var[big], rtol=0.25)


def test_biased_randomk_is_k_over_d_times_x_in_expectation():
    x = vector(40, seed=2)
    samples = draws(make("randomk", ratio=0.25, randomk_unbiased=False), x, shared=True, n=600)
    # per coordinate the mean's standard error is 0.43 |x_i| / sqrt(600) = 0.018 |x_i|: 5.5 of them
    torch.testing.assert_close(samples.mean(0), 0.25 * x, atol=0.1 * x.abs().max(), rtol=0)
    assert all(int((s != 0).sum()) == 10 for s in samples[:20]), "exactly k = 10 coordinates each draw"


@pytest.mark.parametrize("method", ["topk", "randomk", "threshold", "terngrad", "qsgd", "fp16", "powersgd"])
def test_error_feedback_conserves_the_gradient(method):
    """sent + residual = g + previous residual, every step; so sum(sent) + e_T = sum(g) over T steps."""
    comp = make(method, ratio=0.2, threshold=0.5, levels=2, rank=1)
    memory, rng = ErrorFeedback(), CounterRNG(0, 0)
    total_g, total_sent = torch.zeros(60, dtype=torch.float64), torch.zeros(60, dtype=torch.float64)
    for step in range(6):
        g = vector(60, seed=10 + step)
        total_g += g.double()
        compensated = memory.compensate(0, g.clone())
        payload, ctx = comp.compress(compensated, 1, rng, rng, key=0, rows=6)
        if comp.rounds > 1:  # one rank: the sums are the payloads themselves
            second = comp.next_round(payload, ctx)  # orthonormalizes payload[0] in place
            comp.finish_round(second, ctx)
            payload = payload + second
        sent = comp.decompress(payload, ctx)
        memory.update(0, compensated, sent)
        total_sent += sent.double()
        rng.advance()
    torch.testing.assert_close(
        total_sent + memory.residual[0].double(), total_g, atol=1e-4, rtol=0
    )  # fp32 rounding of 6 steps
    assert memory.residual[0].abs().sum() > 0 or method == "fp16"


def test_powersgd_recovers_a_low_rank_matrix():
    torch.manual_seed(0)
    m = torch.randn(12, 2) @ torch.randn(2, 9)
    comp, rng = PowerSGD(rank=2), CounterRNG(0, SHARED_STREAM)
    for _ in range(3):  # warm start: each step one more power iteration
        payload, ctx = comp.compress(m.flatten(), 1, rng, rng, key=5, rows=12)
        second = comp.next_round([payload[0].clone()], ctx)
        comp.finish_round(second, ctx)
        approx = comp.decompress([_orthonormalize(payload[0]), second[0]], ctx)
        # P (12 x 2) and Q (9 x 2) went out, not the matrix: 42 numbers of 108
        assert not ctx[3] and [t.shape for t in payload + second] == [(12, 2), (9, 2)], ctx[3]
    torch.testing.assert_close(approx.reshape(12, 9), m, atol=1e-4, rtol=1e-4)


def test_counter_rng_is_uniform_reproducible_and_separates_streams():
    a, b, shared = CounterRNG(1, 0), CounterRNG(1, 1), CounterRNG(1, SHARED_STREAM)
    u = a.uniform(100000)
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    assert not torch.equal(a.uniform(100), b.uniform(100)), "ranks draw independently"
    assert not torch.equal(a.uniform(100, key=1), a.uniform(100, key=2)), "chunks draw independently"
    first = shared.uniform(100)
    shared.advance()
    assert not torch.equal(first, shared.uniform(100)), "each step draws anew"
    shared.reset()
    assert torch.equal(first, shared.uniform(100)) and torch.equal(first, CounterRNG(1, SHARED_STREAM).uniform(100))


def test_counter_rng_draws_the_numbers_it_always_drew():
    """Pinned draws (x 2^24): the hash's constants and the int and tensor mixers cannot drift."""
    rng = CounterRNG(7, 3)
    rng.advance()
    rng.advance()
    assert (rng.uniform(4, key=5) * 2**24).long().tolist() == [12107201, 4468790, 4386286, 10626041]
    assert (CounterRNG(0, SHARED_STREAM).uniform(3) * 2**24).long().tolist() == [1928145, 8382159, 7098216]
    for x in (0, 1, 0x9E3779B1, MASK32):  # the one mixer, on a host int and on a device tensor alike
        assert _mix(x) == int(_mix(torch.tensor(x, dtype=torch.int64)))


def test_pack_unpack_roundtrip_mixed_dtypes():
    parts = [
        torch.randn(5),
        torch.arange(3, dtype=torch.int32),
        torch.tensor([1, -1, 0], dtype=torch.int8),
        torch.zeros(0),
        torch.randn(2, 3).half(),
    ]
    buf, layout = pack(parts)
    assert buf.dtype == torch.uint8 and all(o % 8 == 0 for o, *_ in layout)
    for a, b in zip(parts, unpack(buf.clone(), layout), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_config_refuses_settings_that_cannot_work():
    ok = Config(compress="topk")
    validate(ok)
    cases = [
        ({"compress_ratio": 0.0}, "--compress-ratio"),
        ({"compress_ratio": 1.5}, "--compress-ratio"),
        ({"qsgd_levels": 0}, "--qsgd-levels"),
        ({"powersgd_rank": 0}, "--powersgd-rank"),
        ({"compress_threshold": -1.0}, "--compress-threshold"),
        ({"comm": "ddp"}, "--comm bucketed"),
        ({"compress": "powersgd", "compress_transport": "dense"}, "dense"),
        ({"compress_scope": "net"}, "--compress-scope"),
    ]
    for overrides, words in cases:
        with pytest.raises(ConfigError, match=words.replace("-", r"\-")):
            validate(Config(**{"compress": "topk", **overrides}))
    validate(Config(compress="topk", cuda_graphs="on"))  # fixed-size payloads can be captured
    # --cuda-graphs on with a payload that cannot be captured: graphs.resolve refuses it, on several
    # ranks only (tests/unit/test_graphs.py), since one rank compresses nothing


def test_alexnet_preset_builds_the_cifar_alexnet():
    cfg = validate(from_preset("alexnet"))
    model = AlexNet(widths=cfg.widths)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert sum(p.numel() for p in model.parameters()) == 2473418
    with pytest.raises(ConfigError, match="five"):
        validate(Config(arch="alexnet"))


def _compressed_step(method, warmup_steps=0, **options):
    """A small net whose gradients go through GradBuckets with ``method``: (compression, step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    compression = Compression(
        make(method, **options), scope="layer", error_feedback=True, warmup_steps=warmup_steps, seed=1
    )
    buckets = GradBuckets(model.parameters(), bucket_mb=1.0, compression=compression)
    x, y = torch.randn(8, 12), torch.randint(0, 3, (8,))

    def step():
        torch.nn.functional.cross_entropy(model(x), y).backward()
        buckets.finish()
        buckets.zero_grad()

    return compression, step


@pytest.mark.parametrize(
    "method, options", [("powersgd", {"rank": 1}), ("threshold", {"threshold": 0.01}), ("topk", {"ratio": 0.25})]
)
def test_compress_time_leaves_out_the_blocking_collectives(one_rank_group, monkeypatch, method, options):
    """A peer 1 s late on every collective, on a fake clock that moves only then: compress_s stays 0.
    Counted, PowerSGD's second all-reduce and Threshold's count all-gather added 1 s a step."""
    clock = types.SimpleNamespace(t=0.0)
    monkeypatch.setattr(engine, "time", types.SimpleNamespace(perf_counter=lambda: clock.t))
    waited = []

    class LateWork:
        def __init__(self, work):
            self.work = work

        def wait(self):
            clock.t += 1.0
            waited.append("async")
            return self.work.wait()

    def late(real):
        def collective(*args, **kwargs):
            if kwargs.get("async_op"):
                return LateWork(real(*args, **kwargs))
            clock.t += 1.0  # blocking: this rank waits for the late peer here
            waited.append("blocking")
            return real(*args, **kwargs)

        return collective

    monkeypatch.setattr(dist, "all_reduce", late(dist.all_reduce))
    monkeypatch.setattr(dist, "all_gather", late(dist.all_gather))
    compression, step = _compressed_step(method, **options)
    for _ in range(3):
        step()
    assert ("blocking" in waited) == (method != "topk") and "async" in waited, waited  # the check saw them
    assert compression.stats.compress_s == 0.0, compression.stats.compress_s


def test_steps_are_counted_on_the_device_so_graph_replays_count(one_rank_group):
    """Graph replays run a step's device ops and none of its Python: after reset() (as after the
    trainer's capture) only end_step's RNG advances run, as in a replay. The summary still counts
    every step; bytes come from the captured step, and no host compress time is claimed."""
    compression, step = _compressed_step("topk", ratio=0.25)
    step()  # eager, as the capture is
    step_bytes = log_stats(compression, _log(), run=1)["bytes_per_step"]
    compression.reset()
    for _ in range(5):  # five replays
        compression.rng.advance()
        compression.shared.advance()
    record = log_stats(compression, _log(), run=1)
    assert record["steps"] == 5 and record["compressed_steps"] == 5, record
    assert record["bytes_per_step"] == step_bytes and record["compress_ms_per_step"] is None, record
    # steps whose Python runs are counted alike, the dense warm-up ones apart
    compression, step = _compressed_step("topk", warmup_steps=2, ratio=0.25)
    for _ in range(3):
        step()
    record = log_stats(compression, _log(), run=1)
    assert record["steps"] == 3 and record["compressed_steps"] == 1 and record["compress_ms_per_step"] > 0, record


def _log():
    """What log_stats writes to: a run log's summary fields and lines."""
    return types.SimpleNamespace(meta={}, line=lambda text: None)
