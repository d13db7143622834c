"""The bucketed all-reduce (fastcifar.parallel.comm) and launch hardening, on the CPU with gloo.

Two-rank tests start real processes with RANK/WORLD_SIZE/MASTER_PORT set, as torchrun would, and
bound every wait: a test that hangs fails at its own timeout instead of stalling CI.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import pytest
import torch
from cli import ROOT, SHORT, epochs_of, free_port, run_dirs, run_train, summary_of, torchrun
from comm_worker import TINY16, SmallNet, default_preset_model, make_model, reference_params, step_trace
from conftest import one_line_error

from fastcifar.core.config import Config
from fastcifar.models.network import build_model
from fastcifar.parallel.comm import LAST_BUCKET_BYTES, GradBuckets, plan_buckets

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "comm_worker.py"
DIST_TIMEOUT_S = 10  # the trainer's --dist-timeout-s in the failure tests
SLACK_S = 60  # start-up (two torch imports on 2 shared cores) plus exit, on top of the timeout
MB = 2**20


# ---------------------------------------------------------------------------------------------
# The bucket plan and the views, in one process (communication skipped).


def test_plan_takes_reverse_order_and_caps_size():
    params = list(make_model().parameters())
    largest = max(p.numel() * 4 for p in params)
    for cap in (10**9, largest - 1, 1):
        buckets = plan_buckets(params, cap)
        flat = [p for b in buckets for p in b.params]
        assert [id(p) for p in flat] == [id(p) for p in reversed(params)], "reverse registration order"
        for b in buckets:
            size = sum(p.numel() * 4 for p in b.params)
            assert size <= cap or len(b.params) == 1, f"bucket {b.index}: {size} bytes over the cap {cap}"
    assert len(plan_buckets(params, 10**9)) == 1
    assert len(plan_buckets(params, 1)) == len(params)
    mid = plan_buckets(params, largest - 1)
    assert 1 < len(mid) < len(params)
    (own,) = [b for b in mid if any(p.numel() * 4 == largest for p in b.params)]
    assert len(own.params) == 1, "a tensor bigger than the cap gets a bucket of its own"


def test_plan_one_dtype_per_bucket_ordered_by_last_gradient():
    model = build_model(Config(widths=(8, 16, 32, 64)), torch.device("cpu"), torch.float32)
    for m in model.modules():  # the GPU layout: fp16 conv and linear weights, fp32 batchnorm
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
            m.half()
    params = list(model.parameters())
    position = {id(p): i for i, p in enumerate(reversed(params))}
    buckets = plan_buckets(params, 64 * 1024)
    assert {p.dtype for p in params} == {torch.float16, torch.float32}
    assert all(len({p.dtype for p in b.params}) == 1 for b in buckets)
    last = [max(position[id(p)] for p in b.params) for b in buckets]
    assert last == sorted(last), "buckets launch in the order their last gradient arrives"
    assert sorted(id(p) for b in buckets for p in b.params) == sorted(id(p) for p in params)


def test_grads_are_strided_views_that_backward_fills_in_place():
    cfg = Config(widths=(8, 16, 32, 64))
    torch.manual_seed(0)
    model = build_model(cfg, torch.device("cpu"), torch.float32)
    reference = build_model(cfg, torch.device("cpu"), torch.float32)
    reference.load_state_dict(model.state_dict())
    buckets = GradBuckets(model.parameters(), bucket_mb=0.05, communicate=False)
    convs = [p for p in model.parameters() if p.dim() == 4]
    assert convs and all(p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous() for p in convs), (
        "the test needs channels-last conv weights"
    )
    before = {id(p): (p.grad.data_ptr(), p.grad.stride()) for p in model.parameters()}
    x = torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    for _ in range(2):
        model(x).float().sum().backward()
        buckets.finish()
        reference(x).float().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (p.grad.data_ptr(), p.grad.stride()) == before[id(p)], f"{name}: .grad left its bucket"
        assert p.grad.stride() == p.stride(), f"{name}: grad strides {p.grad.stride()} != {p.stride()}"
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")
    assert any(b.flat.abs().sum() > 0 for b in buckets.buckets), "the buckets hold the gradients"
    buckets.zero_grad()
    assert all(p.grad.abs().sum() == 0 for p in model.parameters()), "zeroing the buckets zeroes every grad"


def test_replaced_grad_and_double_backward_fail_clearly():
    model = SmallNet()
    buckets = GradBuckets(model.parameters(), bucket_mb=1.0, communicate=False)
    x = torch.randn(2, 3, 8, 8)
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="accumulated twice before finish"):
        model(x).sum().backward()
    buckets.finish()
    model.zero_grad()  # set_to_none=True: autograd would allocate a fresh grad outside the bucket
    with pytest.raises(RuntimeError, match="no longer lives in its bucket"):
        model(x).sum().backward()


def test_buckets_launch_in_bucket_order_even_when_completed_out_of_order():
    model = SmallNet()
    trace: list = []
    buckets = GradBuckets(model.parameters(), bucket_mb=1e-9, communicate=False, trace=trace)
    # Reverse what backward does: hand the parameters their gradients in registration order.
    for p in model.parameters():
        p.grad.add_(1.0)
        buckets._on_grad(p)
    buckets.finish()
    assert trace.pop() == ("finish", None)  # every bucket was complete: finish() launched none
    launches = [i for kind, i in trace if kind == "launch"]
    assert launches == list(range(len(buckets)))
    assert trace.index(("launch", 0)) == len(trace) - len(buckets), "nothing launched before bucket 0 was ready"


# ---------------------------------------------------------------------------------------------
# Two gloo ranks against one process.


def rank_env(rank: int, port: int, world_size: int = 2) -> dict:
    return dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )


def start_ranks(argv_of, out: Path, world_size: int = 2) -> list:
    """One process per rank (forked where forkserver.popen can: each is signalled as a Popen);
    ``argv_of(rank)`` is its command; stdout/stderr go to files in ``out``."""
    port = free_port()
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world_size):
        stdout = open(out / f"stdout{rank}", "w")
        stderr = open(out / f"stderr{rank}", "w")
        env = rank_env(rank, port, world_size)
        procs.append(forkserver.popen(argv_of(rank), cwd=ROOT, env=env, stdout=stdout, stderr=stderr))
    return procs


def wait_all(procs, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes


def read(out: Path, name: str) -> str:
    return (out / name).read_text()


BUCKET_CASES = {"one bucket": 100.0, "a bucket per tensor": 1e-6, "cap below the largest tensor": 0.004}


@pytest.fixture(scope="module")
def two_rank_dir(tmp_path_factory) -> Path:
    """One launch of 2 worker ranks: the training steps (rank{r}.pt), then the fp16 checks (low{r}.pt)."""
    out = tmp_path_factory.mktemp("comm")
    procs = start_ranks(
        lambda r: [sys.executable, str(WORKER), "train", str(out), *map(str, BUCKET_CASES.values())], out
    )
    codes = wait_all(procs, timeout=240)
    assert codes == [0, 0], read(out, "stderr0")[-2000:] + read(out, "stderr1")[-2000:]
    return out


@pytest.fixture(scope="module")
def two_rank_results(two_rank_dir):
    return [torch.load(two_rank_dir / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("case", BUCKET_CASES)
@pytest.mark.slow  # over 2 s on 2 cores
def test_two_ranks_match_one_process_over_the_global_batch(two_rank_results, case):
    mb = BUCKET_CASES[case]
    ref = reference_params()
    ranks = [r[mb] for r in two_rank_results]
    n_params = len(ref)
    expected = {
        "one bucket": lambda n: n == 1,
        "a bucket per tensor": lambda n: n == n_params,
        "cap below the largest tensor": lambda n: 1 < n < n_params,
    }[case]
    assert expected(ranks[0]["n_buckets"]), f"{case}: {ranks[0]['n_buckets']} buckets"
    if case == "cap below the largest tensor":
        assert ["conv3.weight"] in ranks[0]["bucket_params"], ranks[0]["bucket_params"]
    for name, want in ref.items():
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), f"{name}: ranks differ"
        torch.testing.assert_close(
            ranks[0]["params"][name], want, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{case}, {name}: {m}"
        )
    assert all(r["views_kept"] for r in ranks), "a .grad left its bucket or changed strides"


def test_first_bucket_launches_before_backward_ends(two_rank_results):
    for rank in two_rank_results:
        result = rank[BUCKET_CASES["a bucket per tensor"]]
        n = result["n_buckets"]
        step = result["trace"][: len(result["trace"]) // 4]  # the first of the 4 steps
        kinds = [kind for kind, _ in step]
        first_launch, last_grad = kinds.index("launch"), len(kinds) - 1 - kinds[::-1].index("grad")
        assert first_launch < last_grad, f"no overlap: {step}"
        assert [i for kind, i in step if kind == "launch"] == list(range(n))


def test_last_bucket_launches_inside_backward_on_two_gloo_ranks(two_rank_results):
    """The default preset's network on 2 gloo ranks: in both steps (whitening bias trainable, then
    frozen) every bucket launches from backward's hooks, the last from the last gradient, in the
    same order on both ranks; the last bucket is small and the frozen bias in no bucket."""
    traces = [rank["default preset"] for rank in two_rank_results]
    assert traces[0]["plans"] == traces[1]["plans"]
    for step, plan in enumerate(traces[0]["plans"]):
        events = [rank["steps"][step] for rank in traces]
        assert [e for e in events[0] if e[0] == "launch"] == [e for e in events[1] if e[0] == "launch"]
        for trace in events:
            assert trace[-1] == ("finish", None) and trace[-2] == ("launch", len(plan) - 1), trace[-4:]
            assert trace[-3][0] == "grad", "the last bucket launched from the last gradient's hook"
            assert [i for kind, i in trace if kind == "launch"] == list(range(len(plan)))
        nbytes, members = plan[-1]
        assert nbytes <= LAST_BUCKET_BYTES and "blocks.0.conv1.conv.weight" in members
        frozen = step == 1
        assert ("whiten.bias" in {n for _, ns in plan for n in ns}) is not frozen


@pytest.mark.slow  # over 2 s on 2 cores
def test_different_model_shapes_fail_on_every_rank(tmp_path):
    procs = start_ranks(lambda r: [sys.executable, str(WORKER), "shapes"], tmp_path)
    assert wait_all(procs, timeout=120) == [2, 2]
    for r in range(2):
        line = one_line_error(read(tmp_path, f"stderr{r}"))
        assert line.startswith(
            f"fastcifar: error: [rank {r}] ranks disagree on the model's parameter shapes: rank(s) 1 differ"
        ), line


# ---------------------------------------------------------------------------------------------
# fp16 near its underflow: the bucket sums, then divides once (issue 46).

U16, U32, TINY32 = 2.0**-11, 2.0**-24, 2.0**-149  # unit roundoffs, fp32's smallest subnormal


@pytest.fixture(scope="module")
def low_precision_results(two_rank_dir):
    return [torch.load(two_rank_dir / f"low{r}.pt") for r in range(2)]


def test_fp16_average_keeps_what_dividing_first_flushed(low_precision_results):
    """Hand-set gradients on 2 ranks. Summed, then halved once, the fp16 mean is within one
    rounding of the exact mean: |error| <= u16 |mean| + 2^-25 (the sum's relative rounding, and
    half the spacing 2^-24 of fp16's subnormals for the halving). Dividing first rounded each rank's
    half on that grid: 2^-24 on both ranks came out 0, odd multiples of it 2^-24 off. fp32 keeps
    the former bits: halving is exact in binary, before the sum or after."""
    ranks = [r["set"] for r in low_precision_results]
    assert ranks[0]["n_buckets"] > 2, "several buckets, fp16 and fp32"
    for name, mean in ranks[0]["mean"].items():
        assert torch.equal(mean, ranks[1]["mean"][name]), f"{name}: ranks hold different averages"
        g0, g1 = ranks[0]["inputs"][name], ranks[1]["inputs"][name]
        exact = (g0.double() + g1.double()) / 2
        if name == "fp32":
            assert torch.equal(mean, g0 / 2 + g1 / 2) and torch.equal(mean, (g0 + g1) / 2), name
            continue
        assert mean.dtype == torch.float16
        err = (mean.double() - exact).abs()
        bound = U16 * exact.abs() + TINY16 / 2
        worst = int((err - bound).argmax())
        assert bool((err <= bound).all()), (
            f"{name}: element {worst}: mean {float(mean[worst]):.6g}, exact "
            f"{float(exact[worst]):.6g}, error {float(err[worst]):.3g} > bound "
            f"{float(bound[worst]):.3g}"
        )
    flushed, odd = ranks[0]["mean"]["flush"], ranks[0]["mean"]["odd"]
    assert bool((flushed.double() == TINY16).all()), f"2^-24 on both ranks averaged to {flushed.tolist()}"
    assert torch.equal(odd.double(), (ranks[0]["inputs"]["odd"].double() + ranks[1]["inputs"]["odd"].double()) / 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_two_ranks_average_equals_one_process_as_closely_as_fp32_does(low_precision_results, dtype):
    """A linear layer's summed-loss weight gradients near 1e-7, each rank on half the batch. The
    average over 2 ranks is one process's gradient over the whole batch, halved, to within what
    rounding allows, the same bound for fp16 and fp32: each rank's gradient, the process's and the
    sum of the ranks' round once to the dtype (u x (|g0| + |g1| + |G|)); the matmuls' fp32
    accumulations (4 and 8 terms) err by up to 16 u32 x the sum of |terms|; the halving and the
    three roundings' absolute parts stay below 2 x the dtype's smallest subnormal."""
    r0, r1 = (r[str(dtype)] for r in low_precision_results)
    assert torch.equal(r0["mean"], r1["mean"]) and torch.equal(r0["one_process"], r1["one_process"])
    g0, g1, whole = r0["rank_grad"].double(), r1["rank_grad"].double(), r0["one_process"].double()
    if dtype == torch.float16:  # the case this is about: most of the gradient below fp16's normal range
        assert float((whole.abs() < 2.0**-14).double().mean()) > 0.5, whole
    u, tiny = (U16, TINY16) if dtype == torch.float16 else (U32, TINY32)
    err = (r0["mean"].double() - whole / 2).abs()
    bound = u * (g0.abs() + g1.abs() + whole.abs()) + 16 * U32 * r0["abs_terms"] + 2 * tiny
    assert bool((err <= bound).all()), f"{dtype}: error / bound up to {float((err / bound).max()):.2f}"


# ---------------------------------------------------------------------------------------------
# Capture safety: a collective issued during a CUDA graph capture must be in the capture.


class FakeStream:
    """A CUDA stream's capture state: ``wait_stream`` on a capturing stream joins the capture,
    as a CUDA event wait does (``joins=False``: a stream that would not)."""

    def __init__(self, capturing: bool = False, joins: bool = True):
        self.capturing, self.joins = capturing, joins

    def wait_stream(self, other) -> None:
        if other.capturing and self.joins:
            self.capturing = True


class FakeWork:
    def wait(self) -> None:
        pass


@pytest.fixture
def fake_cuda_streams(monkeypatch):
    """torch.cuda's current stream, stream switch and capture query, over FakeStreams."""
    state = {"current": FakeStream()}

    @contextlib.contextmanager
    def stream(s):
        before, state["current"] = state["current"], s
        try:
            yield
        finally:
            state["current"] = before

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state["current"])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["current"].capturing)
    return state


def _issued_collectives(state, comm: FakeStream) -> list:
    """Buckets launched by ``finish`` with ``comm`` as their stream: whether each collective saw a
    capturing current stream when it was issued."""
    buckets = GradBuckets(SmallNet().parameters(), bucket_mb=1e-9, communicate=False)
    buckets.communicate, buckets.stream = True, comm  # the GPU branch, with the collective faked
    seen = []
    buckets._all_reduce_mean = lambda flat: seen.append(torch.cuda.is_current_stream_capturing()) or FakeWork()
    buckets.finish()
    assert len(seen) == len(buckets) > 1
    return seen


def test_collectives_issued_during_capture_join_it(fake_cuda_streams):
    fake_cuda_streams["current"] = FakeStream(capturing=True)  # backward runs inside a capture
    assert all(_issued_collectives(fake_cuda_streams, FakeStream())), "a collective outside the capture"
    fake_cuda_streams["current"] = FakeStream()  # eager: nothing to join, nothing refused
    assert not any(_issued_collectives(fake_cuda_streams, FakeStream()))


def test_a_collective_outside_the_capture_is_refused(fake_cuda_streams):
    """A comm stream that did not join the capture would run its all-reduce once, at capture
    time, and leave it out of every replay: refused with one line, before it is issued."""
    fake_cuda_streams["current"] = FakeStream(capturing=True)
    with pytest.raises(
        RuntimeError, match="gradient bucket 0's all-reduce would be issued outside the CUDA graph being captured"
    ) as err:
        _issued_collectives(fake_cuda_streams, FakeStream(joins=False))
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------
# The trainer: bad launches end with one line and a non-zero exit on every rank, within a bound.


def trainer(data, out, extra):
    return lambda rank: [
        sys.executable,
        "-m",
        "fastcifar.train",
        "--data",
        str(data),
        "--out-dir",
        str(out),
        *SHORT,
        "--dist-timeout-s",
        str(DIST_TIMEOUT_S),
        *extra(rank),
    ]


@pytest.mark.slow
def test_different_configs_fail_on_every_rank(learnable_data, tmp_path):
    procs = start_ranks(trainer(learnable_data, tmp_path / "runs", lambda r: ["--lr", str(0.4 + r)]), tmp_path)
    assert wait_all(procs, timeout=120) == [2, 2]
    for r in range(2):
        line = one_line_error(read(tmp_path, f"stderr{r}"))
        assert line.startswith(f"fastcifar: error: [rank {r}] ranks disagree on the config: rank(s) 1"), line


@pytest.mark.slow
def test_batch_that_does_not_divide_fails_on_every_spawned_rank(learnable_data, tmp_path):
    procs = start_ranks(trainer(learnable_data, tmp_path / "runs", lambda r: ["--batch-size", "101"]), tmp_path)
    assert wait_all(procs, timeout=120) == [2, 2]
    for r in range(2):
        assert "does not divide over 2 ranks" in read(tmp_path, f"stderr{r}")


def start_long_training(learnable_data, tmp_path, extra=()) -> list[subprocess.Popen]:
    procs = start_ranks(trainer(learnable_data, tmp_path / "runs", lambda r: ["--epochs", "200", *extra]), tmp_path)
    deadline = time.monotonic() + 120
    while "train_loss" not in read(tmp_path, "stdout0"):  # rank 0 printed the epoch header: training
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), read(tmp_path, "stderr0")
        time.sleep(0.2)
    return procs


@pytest.mark.slow  # two ranks, one lost: the other waits out its timeout
@pytest.mark.parametrize("how", ["killed", "stalled"])
def test_a_rank_that_dies_or_stalls_ends_the_others_within_the_timeout(learnable_data, tmp_path, how):
    procs = start_long_training(learnable_data, tmp_path)
    procs[1].send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    try:  # the timeout only keeps a hang from hanging the suite; the rank's own bound is its message
        code = procs[0].wait(timeout=DIST_TIMEOUT_S + SLACK_S)
    finally:
        procs[1].kill()
        wait_all(procs, timeout=30)
    assert code == 3, read(tmp_path, "stderr0")[-2000:]
    line = one_line_error(read(tmp_path, "stderr0"))
    assert line.startswith("fastcifar: error: [rank 0] lost contact with the other ranks"), line


@pytest.mark.slow
def test_a_killed_rank_0_still_leaves_a_summary_written_by_a_survivor(learnable_data, tmp_path):
    """issue 70: rank 0 alone wrote summary.json, so a SIGKILLed rank 0 left its run folder without
    one. Rank 1 knows the folder (rank 0 sends it after making it) and writes one on its way out."""
    procs = start_long_training(learnable_data, tmp_path)
    procs[0].send_signal(signal.SIGKILL)
    try:  # a guard against a hang, not a timing assertion
        code = procs[1].wait(timeout=DIST_TIMEOUT_S + SLACK_S)
    finally:
        wait_all(procs, timeout=30)
    assert code == 3, read(tmp_path, "stderr1")[-2000:]
    assert one_line_error(read(tmp_path, "stderr1")).startswith("fastcifar: error: [rank 1] lost contact")
    summary = summary_of(tmp_path / "runs")
    assert summary["status"] == "failed" and summary["stopped"].startswith("lost contact with the other ranks")
    assert summary["written_by"].startswith("rank 1: rank 0 left no summary") and summary["results"] == []
    assert summary["config"]["epochs"] == 200


@pytest.mark.slow
def test_a_rank_that_never_joins_ends_the_others_within_the_timeout(learnable_data, tmp_path):
    port = free_port()
    argv = trainer(learnable_data, tmp_path / "runs", lambda r: ["--dist-timeout-s", "5"])(0)
    proc = subprocess.run(
        argv, cwd=ROOT, env=rank_env(0, port), capture_output=True, text=True, timeout=5 + SLACK_S
    )  # a guard against a hang, not a timing assertion
    assert proc.returncode == 3, proc.stderr[-2000:]
    line = one_line_error(proc.stderr)
    assert line.startswith("fastcifar: error: [rank 0] lost contact with the other ranks") and "1/2" in line, line


@pytest.mark.slow  # two torchrun ranks train twice (buckets, then DDP)
def test_two_ranks_bucketed_learns_and_reproduces_ddp_under_torchrun(learnable_data, tmp_path):
    epochs, stdout = {}, {}
    for comm in ("bucketed", "ddp"):
        out = tmp_path / comm
        proc = run_train(
            [
                "--data",
                learnable_data,
                "--out-dir",
                out,
                *SHORT,
                "--epochs",
                "2",
                "--comm",
                comm,
                "--bucket-mb",
                "0.05",
            ],
            launcher=torchrun(),
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert len(run_dirs(out)) == 1, "only rank 0 writes files"
        stdout[comm] = proc.stdout
        s = summary_of(out)
        assert s["config"]["comm"] == comm and s["device"]["world_size"] == 2
        epochs[comm] = epochs_of(s, ("train_loss", "test_loss", "test_acc"))
    assert "gradient buckets" in stdout["bucketed"] and "gradient buckets" not in stdout["ddp"]
    assert epochs["bucketed"][-1][2] > 60.0, epochs
    # Both divide by 2 before a two-term sum (exact in binary) from the same weights and batches:
    # the same bits, so the same losses, unless an average or an ordering went wrong.
    assert epochs["bucketed"] == epochs["ddp"]


def test_apple8_launcher_spells_out_the_seed_recipe():
    script = ROOT / "scripts" / "launch_apple8.sh"
    one = subprocess.run(
        ["bash", str(script), "--data", "d"],
        env=dict(os.environ, DRY_RUN="1"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert one.returncode == 0, one.stderr
    assert (
        "--nproc_per_node 8 --standalone -m fastcifar.train --preset resnet9 --batch-size 2048 "
        "--comm bucketed --data d" in one.stdout
    ), one.stdout
    multi = subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ, DRY_RUN="1", NNODES="2", RDZV_ENDPOINT="host0:29500"),
    )
    assert "--nnodes 2 --rdzv-backend c10d --rdzv-endpoint host0:29500" in multi.stdout, multi.stdout


# ---------------------------------------------------------------------------------------------
# The last bucket (issue 73): what backward completes last is small, and a frozen parameter is in
# no bucket, on the default preset's own network (the GPU layout: fp16 weights, fp32 batchnorm).


def test_last_bucket_of_the_default_preset_is_its_small_first_layers():
    cfg, model = default_preset_model()
    names = {p: n for n, p in model.named_parameters()}
    buckets = plan_buckets(model.parameters(), int(cfg.bucket_mb * MB))
    sizes = [b.numel * torch.empty(0, dtype=b.dtype).element_size() for b in buckets]
    last = buckets[-1]
    assert {names[p] for p in last.params} == {
        "whiten.bias",
        "blocks.0.conv1.conv.weight",
        "blocks.0.conv2.conv.weight",
    }, "the last bucket holds what backward produces last: the first layers"
    assert sizes[-1] <= LAST_BUCKET_BYTES and sizes[-1] == min(
        s for s, b in zip(sizes, buckets, strict=True) if b.dtype == torch.float16
    ), f"the last bucket must be the small one: {sizes}"
    assert max(sizes) <= cfg.bucket_mb * MB and sum(sizes) < 4.0e6, sizes  # 3.95 MB of fp16 + 4.6 KB of fp32


def test_last_bucket_launches_during_backward_and_leaves_the_frozen_bias_out():
    """The trace of two steps on the default preset's network: with the whitening bias trainable
    its bucket launches from the bias's own gradient; once it is frozen (as run.recipe freezes it,
    backward then ending at blocks.0) it is in no bucket and nothing waits for finish()."""
    cfg, model = default_preset_model()
    names = {p: n for n, p in model.named_parameters()}
    trace: list = []
    buckets = GradBuckets(model.parameters(), cfg.bucket_mb, communicate=False, names=names, trace=trace)
    x = torch.randn(2, 3, 16, 16).half().contiguous(memory_format=torch.channels_last)  # fp16 on 2 CPU cores
    before = {p: p.grad.data_ptr() for p in buckets.params}  # the first plan's views
    for frozen in (False, True):
        model.whiten.bias.requires_grad_(not frozen)
        events = step_trace(model, buckets, trace, x)
        grads = [i for kind, i in events if kind == "grad"]
        assert ("whiten.bias" in grads) is not frozen
        launched = [i for kind, i in events[: events.index(("finish", None))] if kind == "launch"]
        assert launched == list(range(len(buckets))), f"frozen={frozen}: a bucket left to finish(): {events}"
        in_buckets = {names[p] for b in buckets.buckets for p in b.params}
        assert ("whiten.bias" in in_buckets) is not frozen
        assert buckets.buckets[-1].numel * 2 <= LAST_BUCKET_BYTES
        buckets.zero_grad()
    bias = model.whiten.bias
    assert not any(
        b.flat.data_ptr() <= bias.grad.data_ptr() < b.flat.data_ptr() + b.numel * 2 for b in buckets.buckets
    ), "the frozen bias's gradient lives outside every bucket"
    model.whiten.bias.requires_grad_(True)  # thawed: back to the first plan, its views unchanged
    step_trace(model, buckets, trace, x)
    assert {p: p.grad.data_ptr() for p in buckets.params} == before and bias in before


def test_last_bucket_plans_switch_only_outside_a_capture(monkeypatch):
    """A switch of bucket plans copies gradients and repoints .grad: inside a CUDA graph capture it
    would be recorded and replayed, so it is refused there, for a plan made before as for a new one."""
    cfg, model = default_preset_model()
    buckets = GradBuckets(model.parameters(), cfg.bucket_mb, communicate=False)
    model.whiten.bias.requires_grad_(False)
    buckets.begin()  # eager: the frozen plan is made and current
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    buckets.begin()  # nothing changed since the last step: nothing to refuse
    model.whiten.bias.requires_grad_(True)
    with pytest.raises(RuntimeError, match="changed inside a CUDA graph capture"):
        buckets.begin()  # back to the first plan, which exists, but inside a capture


# ---------------------------------------------------------------------------------------------
# A rank lost before the first epoch (issue 73): the progress watchdog starts with the run, so it
# also covers the model handshake, the warm-up steps and graph capture.

LOSE = Path(__file__).resolve().parents[1] / "helpers" / "lose_rank.py"


@pytest.mark.slow  # two ranks, one lost in start-up: the other waits out its timeout
@pytest.mark.parametrize("how", ["stalled-at-handshake", "killed-in-warm-up"])
def test_a_rank_lost_before_first_epoch_ends_the_other_in_one_line(learnable_data, tmp_path, how):
    """Rank 1 is lost before its first epoch; rank 0 ends with one line, exit 3 and the record
    (docs/distributed.md's bound, --dist-timeout-s + 11 s, is what the guard below leaves room for
    with start-up and exit). On gloo the collective's own timeout races the progress watchdog (both
    --dist-timeout-s), so which one ended it is not asserted; that the watchdog runs from the run's
    start and the warm-up steps beat it is tests/unit/test_components.py's (before_first_epoch)."""
    argv = trainer(learnable_data, tmp_path / "runs", lambda r: ["--epochs", "200"])
    procs = start_ranks(lambda r: [sys.executable, str(LOSE), how, *argv(r)[3:]], tmp_path)
    try:  # the timeout only keeps a hang from hanging the suite
        code = procs[0].wait(timeout=DIST_TIMEOUT_S + SLACK_S)
    finally:
        procs[1].kill()
        wait_all(procs, timeout=30)
    assert code == 3, read(tmp_path, "stderr0")[-2000:]
    assert "train_loss" not in read(tmp_path, "stdout0"), "rank 0 reached an epoch"
    line = one_line_error(read(tmp_path, "stderr0"))
    assert line.startswith("fastcifar: error: [rank 0] lost contact with the other ranks"), line
    assert summary_of(tmp_path / "runs")["status"] == "failed"
