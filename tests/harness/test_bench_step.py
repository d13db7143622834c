"""bench_step's breakdown of a traced step: kernels sorted into phases by name, launch gaps as idle,
and its --preset form (the default preset's FastNet, the trainer's optimizer) on the CPU."""

from __future__ import annotations

import sys

import forkserver
import pytest
from cli import ROOT, bench_results, env
from script_modules import load_script

from fastcifar.core.presets import DEFAULT_PRESET


@pytest.fixture(scope="module")
def bench_step():
    return load_script("bench/bench_step.py")


@pytest.mark.parametrize(
    "name, phase",
    [
        (
            "sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_warpgroupsize1x1x1",
            "convs",
        ),
        ("sm90_xmma_dgrad_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_relu", "convs"),  # fused epilogue: a conv
        ("cudnn::bn_fw_tr_1C11_kernel_NCHW<__half, float, int, 512, true, 1, true>", "bn_act_pool"),
        ("_bwd_dx_kernel", "bn_act_pool"),
        ("_apply_kernel", "bn_act_pool"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>", "optimizer"),  # not _apply_kernel
        ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", "bn_act_pool"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::launch_clamp_scalar(...)>", "bn_act_pool"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::threshold_kernel_impl<c10::Half>(...)>",
            "bn_act_pool",
        ),  # eager ReLU's forward and backward
        ("void at::native::reduce_kernel<512, 1>", "other"),
        ("_conv_stats_kernel", "convs"),  # --fused-conv: the conv, its statistics epilogue included
    ],
)
def test_kernels_fall_into_their_phase(bench_step, name, phase):
    assert bench_step.phase_of(name) == phase


def test_breakdown_attributes_busy_time_and_counts_gaps_as_idle(bench_step):
    kernels = [  # microseconds, over 2 steps
        ("sm90_xmma_fprop_implicit_gemm", 0.0, 10.0),
        ("_apply_kernel", 10.0, 14.0),
        ("multi_tensor_apply_kernel", 20.0, 22.0),  # after a 6 us gap
        ("reduce_kernel", 21.0, 23.0),  # overlaps the previous: no idle between them
        ("empty", 30.0, 30.0),  # zero-length events are dropped
    ]
    parts = bench_step.breakdown(kernels, steps=2)
    ms = 1e-3 / 2
    assert parts["convs_ms"] == pytest.approx(10 * ms)
    assert parts["bn_act_pool_ms"] == pytest.approx(4 * ms)
    assert parts["optimizer_ms"] == pytest.approx(2 * ms)
    assert parts["other_ms"] == pytest.approx(2 * ms)
    assert parts["idle_ms"] == pytest.approx(6 * ms)
    assert parts["idle_share"] == pytest.approx(6 / 23)
    assert parts["top"][0] == ("sm90_xmma_fprop_implicit_gemm", pytest.approx(10 * ms))
    assert parts["busy_ms"] == pytest.approx(17 * ms)  # the union: 0-14 and 20-23
    assert parts["kernels_per_step"] == 2  # 4 kernels over 2 steps, the empty one dropped
    # every kernel named, with its phase, launches and ms per step, the most time first
    assert parts["per_kernel"] == [
        ("sm90_xmma_fprop_implicit_gemm", "convs", 0.5, pytest.approx(10 * ms)),
        ("_apply_kernel", "bn_act_pool", 0.5, pytest.approx(4 * ms)),
        ("multi_tensor_apply_kernel", "optimizer", 0.5, pytest.approx(2 * ms)),
        ("reduce_kernel", "other", 0.5, pytest.approx(2 * ms)),
    ]
    assert bench_step.phase_kernels(parts, "other") == ["| reduce_kernel |  | 0.5 | 0.0010 |"]
    parts["launched_by"] = {"reduce_kernel": "aten::sum"}
    assert bench_step.phase_kernels(parts, "other") == ["| reduce_kernel | aten::sum | 0.5 | 0.0010 |"]
    assert bench_step.phase_kernels({}, "other") == []
    assert bench_step.breakdown([], steps=1) == {}


def test_idle_against_the_plain_step(bench_step, monkeypatch):
    """The row's second idle figure: the traced busy time against the step timed without the tracer
    (H100, `fast`: 11.1% from the trace's span, 2.4% this way); profile_steps hands over busy_ms."""
    import torch

    assert bench_step.idle_against_step(busy_ms=3.0, step_ms=3.2) == pytest.approx(100 * 0.2 / 3.2)
    assert bench_step.idle_against_step(busy_ms=3.3, step_ms=3.2) == 0.0
    monkeypatch.setattr(
        bench_step,
        "traced_kernels",
        lambda run, steps: [("sm90_xmma_fprop", 0.0, 900.0 * steps), ("tail", 1000.0 * steps, 1000.0 * steps + 50)],
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    parts = bench_step.profile_steps(lambda *a: None, None, None, steps=10)
    assert parts["busy_ms"] == pytest.approx((9000 + 50) / 1e3 / 10)
    assert parts["idle_share"] == pytest.approx(1000 / 10050)


@pytest.mark.slow
def test_smoke_run_of_the_default_presets_network():
    before = bench_results()
    proc = forkserver.run(
        [sys.executable, str(ROOT / "bench" / "bench_step.py"), "--smoke", "--preset", DEFAULT_PRESET],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"| fastnet ({DEFAULT_PRESET}) | 4 | torch | off |" in proc.stdout
    assert bench_results() == before


def test_the_timed_step_has_the_trainers_optimizer_for_the_preset(bench_step, monkeypatch):
    """--preset fast-muon times Muon + SGD with the recipe's parameter groups, not a stand-in."""
    import dataclasses

    import torch

    from fastcifar.core.config import from_preset
    from fastcifar.run.optim import MuonSGD

    made, real = [], bench_step.make_optimizer
    monkeypatch.setattr(bench_step, "make_optimizer", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    cfg = dataclasses.replace(from_preset("fast-muon"), widths=(8, 16, 32))
    bench_step.build_step(cfg, 2, False, torch.device("cpu"), torch.float32)
    assert len(made) == 1 and isinstance(made[0], MuonSGD)


def test_fake_world_times_a_ranks_step_whose_buckets_all_reduce_to_the_fake_group(bench_step, monkeypatch):
    """--fake-world N: the step is built as rank 0 of N builds it (GradientSync's buckets over the
    per-rank batch) and every step issues one all-reduce per bucket to the fake N-rank group."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from fastcifar.core.config import from_preset

    sizes, real = [], dist.all_reduce
    monkeypatch.setattr(
        dist, "all_reduce", lambda tensor, *a, **k: sizes.append(tensor.numel()) or real(tensor, *a, **k)
    )
    cpu = torch.device("cpu")
    ctx = bench_step.fake_group(4, cpu)
    sync = None
    try:
        assert (dist.get_backend(), dist.get_world_size(), dist.get_rank()) == ("fake", 4, 0)
        # small buckets, so the plan has several (the shrunk network's gradients are about 60 KB)
        cfg = dataclasses.replace(from_preset(DEFAULT_PRESET), widths=(8, 16, 32), bucket_mb=0.02)
        model, step, images, labels, sync = bench_step.build_step(cfg, 3, False, cpu, torch.float32, ctx)
        buckets = sync.buckets.buckets
        assert len(buckets) >= 2 and sync.buckets.world_size == 4
        assert step.batch.images.shape[0] == 3 and images.shape[0] == 3  # the per-rank batch
        sizes.clear()  # the warm-up steps' collectives
        bench_step.time_steps(step, images, labels, cpu, window=2, repeats=1)
        assert sizes == 2 * [b.numel for b in buckets], (sizes, [b.numel for b in buckets])
    finally:
        if sync is not None:
            sync.remove()
        dist.destroy_process_group()


def test_a_fused_conv_block_counts_its_conv(bench_step):
    """--fused-conv's block computes its conv without calling its nn.Conv2d (whose hook then never
    fires): counted from the block, the network's FLOPs are the unfused network's."""
    import torch

    from fastcifar.models.fastnet import FastNet
    from fastcifar.ops.norm_act_pool import ConvBlock

    class Bypass(ConvBlock):  # as TritonConvBlock: the conv's output without calling self.conv
        def forward(self, x):
            return self.norm(torch.nn.functional.conv2d(x, self.conv.weight, padding=self.conv.padding))

    plain = FastNet(widths=(8, 16, 16))
    expected = bench_step.conv_flops_per_image(plain, "cpu", torch.float32)
    for m in plain.modules():
        if type(m) is ConvBlock:
            m.__class__ = Bypass
    assert bench_step.conv_flops_per_image(plain, "cpu", torch.float32) == expected
    assert expected > 10 * 2 * 16 * 10  # the convs, not only the linear head


def test_fused_conv_with_the_torch_kernels_is_refused(bench_step, capsys):
    assert bench_step.main(["--fused-conv", "--kernels", "torch", "triton"]) == 2
    assert (
        capsys.readouterr().err
        == "bench_step: --fused-conv needs the Triton kernels: --kernels triton or auto, not torch\n"
    )


def test_fake_world_refuses_a_batch_that_does_not_divide_over_the_ranks(bench_step, capsys):
    assert bench_step.main(["--fake-world", "3", "--batches", "10"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "bench_step: --batches 10 does not divide over --fake-world 3 ranks "
        "(the per-rank batch must be a whole number of images)\n"
    )
    assert bench_step.main(["--fake-world", "0"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.slow
def test_smoke_run_of_a_ranks_step_at_a_fake_world(tmp_path):
    """The whole --fake-world path on the CPU: the table says the world is a fake group's, with the
    per-rank and global batch; nothing is written."""
    before = bench_results()
    proc = forkserver.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_step.py"),
            "--smoke",
            "--preset",
            DEFAULT_PRESET,
            "--fake-world",
            "8",
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| batch | world_size | global_batch | buckets |" in proc.stdout
    assert f"| fastnet ({DEFAULT_PRESET}) | 2 | 8 | 16 | 1 | torch | off |" in proc.stdout, proc.stdout
    assert "rank 0 of a fake process group" in proc.stdout and "no communication" in proc.stdout
    assert bench_results() == before


def test_the_printed_breakdown_names_every_kernel_of_other(bench_step, monkeypatch, capsys):
    """Issue 50 item 1: the table under the breakdown lists each "other" kernel by name, with its
    launches and ms per step; kernels of the other phases stay out of it."""
    traced = [
        ("sm90_xmma_fprop_implicit_gemm", 0.0, 500.0),
        ("void at::native::reduce_kernel<512, 1>", 500.0, 530.0),
        ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopB_TNT", 530.0, 560.0),
        ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopB_TNT", 560.0, 590.0),
    ]
    monkeypatch.setattr(bench_step, "SMOKE", True)
    monkeypatch.setattr(
        bench_step, "profile_steps", lambda step, images, labels, steps=10: bench_step.breakdown(traced, 1)
    )
    assert bench_step.main(["--smoke", "--preset", DEFAULT_PRESET]) == 0
    out = capsys.readouterr().out
    assert 'the 2 kernels of "other" (0.090 ms a step)' in out
    assert "| kernel | launched by (eager trace) | launches per step | ms per step |" in out
    assert "| nvjet_hsh_128x256_64x4_2x1_v_bz_coopB_TNT |  | 2 | 0.0600 |" in out
    assert "| reduce_kernel<512, 1> |  | 1 | 0.0300 |" in out
    assert "| sm90_xmma_fprop_implicit_gemm |" not in out


def test_short_names_keep_the_functor(bench_step):
    """Visit 12's "other" table cut every name at 90 characters, so PyTorch's elementwise kernels all
    read "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::nati":
    without the namespaces and the lambdas' scaffolding the functor shows."""
    add = (
        "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
        "CUDAFunctor_add<c10::Half> >(at::TensorIteratorBase&, at::native::CUDAFunctor_add<c10::Half> const&)"
        "::{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast<at::native::CUDAFunctor_add<c10::Half> >)"
    )
    short = bench_step.short_name(add)
    assert (
        short.startswith("elementwise_kernel<128, 4, gpu_kernel_impl_nocast<CUDAFunctor_add<Half> >")
        and len(short) == 90
    )
    copy = (
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
        "::{lambda()#3}::operator()() const::{lambda()#10}::operator()() const::{lambda(c10::Half)#1}, "
        "std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned int> >"
    )
    assert bench_step.short_name(copy).startswith(
        "unrolled_elementwise_kernel<direct_copy_kernel_cuda(TensorIteratorBase&)::{lambda(Half)#1}"
    )
    assert bench_step.short_name("_bwd_dx_kernel") == "_bwd_dx_kernel"
    assert (
        bench_step.short_name("void at::native::(anonymous namespace)::softmax_warp_forward<float>(float*)")
        == "softmax_warp_forward<float>(float*)"
    )
    assert bench_step.short_name("nvjet_sm90_tst_64x24_64x16_2x4_h_bz_TNT") == "nvjet_sm90_tst_64x24_64x16_2x4_h_bz_TNT"


def test_launched_by_names_the_op_and_its_autograd_node(bench_step):
    """Each kernel is tied to the innermost op that launched it (the profiler's link) and, where it
    ran inside another, the outermost one: for backward work the autograd node."""
    from types import SimpleNamespace as E

    def op(name, parent=None, kernels=()):
        return E(name=name, cpu_parent=parent, kernels=[E(name=k) for k in kernels])

    node = op("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad")
    accumulate = op("aten::add_", op("torch::autograd::AccumulateGrad", node), ["add_kernel"] * 2)
    backward = op("aten::mul", op("autograd::engine::evaluate_function: MulBackward0"), ["mul_kernel"])
    forward = op("aten::mul", None, ["mul_kernel", "mul_kernel"])
    gemm = op("aten::mm", op("aten::matmul"), ["nvjet"])
    events = [node, accumulate, backward, forward, gemm, op("aten::empty")]
    assert bench_step.launch_label(accumulate) == "aten::add_ in AccumulateGrad"
    assert bench_step.launch_label(forward) == "aten::mul"
    got = bench_step.launched_by(events, steps=2)
    assert got == {
        "add_kernel": "aten::add_ in AccumulateGrad",
        "mul_kernel": "aten::mul x1; aten::mul in MulBackward0 x0.5",
        "nvjet": "aten::mm in aten::matmul",
    }


def test_variants_are_timed_beside_the_preset_with_what_each_removed(bench_step, monkeypatch, capsys):
    """--variants: the preset's step, then each variant's built from the preset and its flags, and
    each variant's row says what it removed from the preset's step at the same batch."""
    import torch

    built = []
    real_build = bench_step.build_step

    def build(cfg, *a, **k):
        built.append(cfg)
        return real_build(cfg, *a, **k)

    # the variant's trace has one "other" kernel fewer: 30 us of 590 over one step
    full = [
        ("sm90_xmma_fprop_implicit_gemm", 0.0, 500.0),
        ("void at::native::reduce_kernel<512, 1>", 500.0, 530.0),
        ("nvjet_hsh_128x256", 560.0, 590.0),
    ]
    traces = iter([full, full[:1] + full[2:]])
    monkeypatch.setattr(bench_step, "SMOKE", True)
    monkeypatch.setattr(bench_step, "build_step", build)
    monkeypatch.setattr(bench_step, "profile_steps", lambda *a, **k: bench_step.breakdown(next(traces), 1))
    monkeypatch.setattr(bench_step, "time_steps", lambda *a, **k: 1.0)
    assert bench_step.main(["--smoke", "--preset", DEFAULT_PRESET, "--variant=--label-smoothing 0.1"]) == 0
    out = capsys.readouterr().out
    assert [c.label_smoothing for c in built] == [bench_step.from_preset(DEFAULT_PRESET).label_smoothing, 0.1]
    assert "What each variant removed from the preset's step" in out
    removed = next(line for line in out.splitlines() if line.startswith("| --label-smoothing 0.1 | 4 |"))
    # other 0.030 ms fewer, the gap it left counted as idle (0.030 more), the step as timed, 1 kernel fewer
    assert removed.endswith("| 0.000 | 0.000 | 0.000 | 0.030 | -0.030 | 0.000 | 1.000 |"), out
    assert torch.get_default_dtype() == torch.float32


def test_variants_are_refused_in_one_line_before_anything_is_measured(bench_step, capsys, monkeypatch):
    monkeypatch.setattr(bench_step, "SMOKE", True)
    monkeypatch.setattr(bench_step, "build_step", lambda *a, **k: pytest.fail("measured a refused variant"))
    argv = ["--smoke", "--preset", DEFAULT_PRESET, "--variant=--label-smoothing 0.1", "--variant=--no-such"]
    assert bench_step.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench_step: variant '--no-such': unrecognized arguments") and "\n" not in err, err
    assert bench_step.main(["--smoke", "--variant=--epochs 7"]) == 2
    assert "--variant needs --preset" in capsys.readouterr().err
