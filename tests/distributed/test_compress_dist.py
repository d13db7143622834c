"""Compressed gradient communication across 2 and 3 gloo ranks (fastcifar.parallel.compress in GradBuckets).

Each rank of tests/helpers/compress_worker.py averages its own gradients of a small net through every
method, scope and transport; these tests compare the results with the uncompressed average, with
each other and across ranks, and check the byte counts against the payload sizes.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from cli import SHORT, run_train, summary_of, torchrun
from compress_worker import BOTH, EXACT, LEARN
from test_comm import start_ranks, wait_all

from fastcifar.parallel.compress import SCOPES

pytestmark = pytest.mark.slow
WORKER = Path(__file__).resolve().parents[1] / "helpers" / "compress_worker.py"


def _results(tmp_path_factory, world: int, mode: str) -> list:
    out = tmp_path_factory.mktemp(f"compress{world}")
    procs = start_ranks(lambda r: [sys.executable, str(WORKER), str(out), mode], out, world_size=world)
    codes = wait_all(procs, timeout=240)
    assert codes == [0] * world, [(out / f"stderr{r}").read_text()[-2000:] for r in range(world)]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _results(tmp_path_factory, 2, "full")


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    return _results(tmp_path_factory, 3, "quick")


def grads(res, key):
    return res[key]["grads"]


def test_exact_settings_equal_the_plain_average_bit_for_bit(two):
    # K=1, V=0 and fp32 through the whole compression machinery, in every scope, on 2 ranks: the
    # same sums in the same order as the plain all-reduce, so the same bits.
    for rank in two:
        reference = rank["reference"]["bucket"]["grads"]
        for name, _, _ in EXACT:
            for scope in SCOPES:
                for a, b in zip(grads(rank, ("exact", name, scope)), reference, strict=True):
                    assert torch.equal(a, b), f"{name} scope {scope}: max diff {(a - b).abs().max()}"


def test_three_ranks_exact_settings_match_and_all_ranks_agree(three):
    reference = three[0]["reference"]["bucket"]["grads"]
    for name, _, _ in EXACT:
        for scope in SCOPES:
            for rank in three:  # the ring may sum 3 ranks in another order: equal to rounding
                for a, b in zip(grads(rank, ("exact", name, scope)), reference, strict=True):
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for key in [k for k in three[0] if isinstance(k, tuple)] + ["empty", "empty_some"]:
        for rank in three[1:]:
            assert all(torch.equal(a, b) for a, b in zip(grads(rank, key), grads(three[0], key), strict=True)), (
                f"{key}: ranks hold different averages"
            )


@pytest.mark.parametrize("fixture", ["two", "three"])
def test_sparse_and_dense_transports_agree(fixture, request):
    results = request.getfixturevalue(fixture)
    scopes = SCOPES if fixture == "two" else ("bucket",)
    for rank in results:
        for name, _, _ in BOTH:
            for scope in scopes:
                sparse, dense = grads(rank, (name, scope, "sparse")), grads(rank, (name, scope, "dense"))
                if name in ("fp16", "bf16"):  # sparse sums the cast values in 16 bits, dense in fp32
                    tol = {"fp16": 1e-3, "bf16": 8e-3}[name]
                    for a, b in zip(sparse, dense, strict=True):
                        torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()))
                elif fixture == "two":
                    assert all(torch.equal(a, b) for a, b in zip(sparse, dense, strict=True)), f"{name} {scope}"
                    # error feedback's residual too: what this rank sent, however it travelled
                    res_s, res_d = rank[(name, scope, "sparse")]["residual"], rank[(name, scope, "dense")]["residual"]
                    assert res_s.keys() == res_d.keys() and all(torch.equal(res_s[c], res_d[c]) for c in res_s), (
                        f"{name} {scope}: residuals differ"
                    )
                else:
                    for a, b in zip(sparse, dense, strict=True):
                        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
                assert rank[(name, scope, "dense")]["stats"]["ratio"] == 1.0, "dense saves nothing"


def _param_elements(rank, key):
    return sum(g.numel() for g in grads(rank, key))


def test_bytes_counted_equal_the_payload_sizes(two):
    rank = two[0]
    aligned = lambda n: (n + 7) // 8 * 8  # noqa: E731  (the packer's 8-byte alignment)
    for scope in SCOPES:
        res = rank[("topk", scope, "sparse")]
        chunk_lengths = [length for chunks in res["chunks"].values() for _, length in chunks]
        # one all-gather per bucket of each chunk's values (fp32) and indices (int32), 8-byte aligned
        expected = 0
        for chunks in res["chunks"].values():
            expected += sum(2 * aligned(4 * math.ceil(0.1 * length)) for _, length in chunks)
        assert res["stats"]["bytes_per_step"] == expected, scope
        assert res["stats"]["dense_bytes_per_step"] == 4 * sum(res["bucket_numel"])
        assert len(chunk_lengths) == {"layer": 5 + 4, "bucket": res["n_buckets"], "model": 1}[scope]
        # shared-coordinate RandomK sums values only: 4 bytes per kept coordinate, one all-reduce
        rk = rank[("randomk", scope, "sparse")]
        assert rk["stats"]["bytes_per_step"] == sum(4 * math.ceil(0.1 * length) for length in chunk_lengths)
        # TernGrad: one int8 per coordinate + one fp32 scale per chunk
        tg = rank[("terngrad", scope, "sparse")]
        assert tg["stats"]["bytes_per_step"] == sum(aligned(length) + 8 for length in chunk_lengths)
        fp16 = rank[("fp16", scope, "sparse")]
        assert fp16["stats"]["bytes_per_step"] == sum(2 * length for length in chunk_lengths)


def test_empty_threshold_selection_does_not_hang_and_keeps_the_residual(two, three):
    for results in (two, three):
        for rank in results:
            res = rank["empty"]
            assert all(g.abs().sum() == 0 for g in grads(rank, "empty")), "nothing selected, nothing averaged"
            # only the per-chunk counts (int64) went out
            assert res["stats"]["bytes_per_step"] == 8 * sum(len(c) for c in res["chunks"].values())
            assert sum(r.abs().sum() for r in res["residual"].values()) > 0, "the dropped gradient is kept"
        # rank 0 selects nothing, the others do: the average still arrives, the same everywhere
        assert sum(g.abs().sum() for g in grads(results[0], "empty_some")) > 0


def test_powersgd_and_randomness_per_rank(two):
    r0, r1 = two
    for scope in SCOPES:
        stats = r0[("powersgd", scope)]["stats"]
        assert stats["ratio"] > 5, f"powersgd rank 1 sends a fraction: {stats}"
        assert all(
            torch.equal(a, b)
            for a, b in zip(grads(r0, ("powersgd", scope)), grads(r1, ("powersgd", scope)), strict=True)
        )
    # Independent draws per rank: with the same seed the per-rank TernGrad residuals still differ
    # in where they kept coordinates; shared-coordinate RandomK keeps the same ones on both.
    t0, t1 = r0[("terngrad", "model", "sparse")]["residual"], r1[("terngrad", "model", "sparse")]["residual"]
    assert not torch.equal(t0[0] == 0, t1[0] == 0)
    # The average is nonzero only where some rank kept a coordinate: at most k per chunk when both
    # kept the same ones (shared), up to about twice that when each drew its own (fewer where a
    # kept gradient is exactly 0: dead ReLUs here, so the counts sit below k and 2k).
    for scope in SCOPES:
        k = sum(
            math.ceil(0.1 * length)
            for chunks in r0[("randomk", scope, "sparse")]["chunks"].values()
            for _, length in chunks
        )
        nonzero = {
            name: sum(int((g != 0).sum()) for g in grads(r0, (name, scope, "sparse")))
            for name in ("randomk", "randomk_rank")
        }
        assert 0.5 * k < nonzero["randomk"] <= k < nonzero["randomk_rank"], (scope, k, nonzero)


@pytest.mark.parametrize("fixture", ["two", "three"])
def test_powersgd_one_step_is_a_projection_of_the_mean(fixture, request):
    # One power iteration from Q0: P = orth(M Q0), A = P (M^T P)^T = P P^T M with M the mean
    # gradient, an orthogonal projection, so <A, M> = <A, A> per parameter (a chunk sent whole has
    # A = M). A wrong 1/world_size in the Q round scales A by n: <A, M> = <A, A> / n. Agreeing
    # ranks and a learning toy net do not see that.
    dot = lambda a, b: float((a.double() * b.double()).sum())  # noqa: E731
    for rank in request.getfixturevalue(fixture):
        approx, mean = grads(rank, "powersgd_1step"), grads(rank, "mean_1step")
        for i, (a, m) in enumerate(zip(approx, mean, strict=True)):
            assert dot(a, m) == pytest.approx(dot(a, a), rel=1e-4, abs=1e-12), (
                f"parameter {i}: <A, M> = {dot(a, m):.6g}, <A, A> = {dot(a, a):.6g}"
            )
        # rank 2 of the 6x27, 12x54, 12x108 and 5x12 weights drops something: a true projection
        dropped = [dot(a, a) < 0.99 * dot(m, m) for a, m in zip(approx, mean, strict=True) if m.dim() > 1]
        assert sum(dropped) == 4, dropped


def test_a_short_training_run_learns_with_each_method(two):
    for rank in two:
        for name, *_ in LEARN:
            first, last = rank["learn"][name]
            assert math.isfinite(last) and last < 0.5 * first, f"{name}: loss {first:.3f} -> {last:.3f}"


def test_trainer_two_ranks_alexnet_with_topk_logs_bytes(learnable_data, tmp_path):
    out = tmp_path / "runs"
    launcher = torchrun()
    args = [
        "--data",
        learnable_data,
        "--out-dir",
        out,
        *SHORT,
        "--epochs",
        "3",
        "--arch",
        "alexnet",
        "--widths",
        "16,32,32,32,32",
        "--compress",
        "topk",
        "--compress-ratio",
        "0.1",
        "--compress-scope",
        "layer",
        "--loader",
        "torch",
    ]
    proc = run_train(args, launcher=launcher, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary_of(out)
    (record,) = s["compression"]
    assert record["steps"] == 3 * 10 and record["compressed_steps"] == 30  # 1000 images, 2 x 50 a step
    assert 4 < record["ratio"] < 5.5, record  # 10% of values + indices: 8 bytes per kept fp32 of 4
    assert record["compress_ms_per_step"] > 0 and "topk" in record["method"]
    assert "compressed communication" in proc.stdout
    assert s["summary"]["acc_mean"] > 30.0, s["summary"]
