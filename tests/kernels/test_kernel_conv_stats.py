"""kernels/conv_stats.py against F.conv2d and conv_bn_act_pool_reference: the conv output, its 2x2
pool and argmax, the statistics partials, the fused block's output, every gradient and the running
statistics, eval mode, odd shapes, several tiles per program, launcher rejections, which blocks
qualify, and a FastNet whose blocks are fused trained against the unfused one.

Runs under TRITON_INTERPRET=1 when there is no GPU (set by _kernel_asserts before triton is
imported), on the GPU otherwise. Shapes are small so that the whole file takes seconds on 2 cores.
"""

import pytest
import torch
import torch.nn.functional as F
from _kernel_asserts import (
    DEVICE,
    assert_close,
    near_tie_windows,
    needs_triton_backend,  # noqa: E402
    poisoned_empty,
    pool_windows,
)

import fastcifar.kernels.bn_act_pool as bap  # noqa: E402
import fastcifar.kernels.conv_stats as cs  # noqa: E402
from bench import kernel_registers  # noqa: E402
from fastcifar.kernels.bn_act_pool import TritonNormActPool  # noqa: E402
from fastcifar.kernels.conv_stats import (
    TritonConvBlock,
    conv_bn_act_pool,  # noqa: E402
    conv_stats_forward,
    fusable,
)
from fastcifar.ops.norm_act_pool import (  # noqa: E402
    ConvBlock,
    NormActPool,
    activation,
    conv_bn_act_pool_reference,
    per_rank,
)

pytestmark = needs_triton_backend

CL = torch.channels_last
# fp32: IEEE products, only the summation order differs from F.conv2d. fp16: the kernel and the
# reference both round an fp32 sum once; a different order can move it by one fp16 step (2^-10
# relative), and the fused block's gradients then as the normalize kernel's tests allow.
CONV_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
TOL = {torch.float32: 3e-5, torch.float16: 1e-2}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Every buffer either launcher allocates starts as NaN (int8 argmax as -1). (On a GPU the fp32
    references run without TF32, as the kernel's fp32: tests/conftest.py's _no_tf32.)"""
    monkeypatch.setattr(bap, "_empty", poisoned_empty(bap._empty))
    monkeypatch.setattr(cs, "_empty", poisoned_empty(cs._empty))


def _conv_inputs(shape, dtype, k=3, seed=0, filter_cl=False):
    n, c_in, c_out, h, w = shape
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, c_in, h, w, generator=g) + 0.2).to(dtype).to(DEVICE).contiguous(memory_format=CL)
    wt = (torch.randn(c_out, c_in, k, k, generator=g) / (c_in * k * k) ** 0.5).to(dtype).to(DEVICE)
    if filter_cl:  # the trainer's filters are channels-last: C_in contiguous
        wt = wt.contiguous(memory_format=CL)
    return x, wt


def _reference_conv(x, wt):
    """F.conv2d in fp32 on the same (rounded) inputs, rounded once to the I/O dtype."""
    return F.conv2d(x.float(), wt.float(), padding=wt.shape[-1] // 2).to(x.dtype)


def _combine(partials, rows):
    """Stage 2 in plain torch: the batch mean and biased variance from the (mean, M2) partials."""
    pmean, pm2, per = partials.pmean.double().cpu(), partials.pm2.double().cpu(), partials.rows_per_prog
    counts = torch.tensor([min(per, rows - i * per) for i in range(pmean.shape[0])], dtype=torch.float64)[:, None]
    mean = (pmean * counts).sum(0) / rows
    m2 = (pm2 + counts * (pmean - mean) ** 2).sum(0)
    return mean, m2 / rows


# (batch, C_in, C_out, H, W); 40 input channels: two K blocks a tap in fp16 too (BLOCK_K 32)
CONV_SHAPES = [
    (3, 5, 7, 7, 7),
    (1, 24, 16, 6, 6),
    (2, 3, 20, 9, 8),
    (2, 24, 70, 5, 5),
    (4, 8, 8, 12, 12),
    (2, 40, 24, 6, 6),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("pool", [None, "before"], ids=["nopool", "before"])
@pytest.mark.parametrize("shape", CONV_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_conv_output_pool_and_statistics(shape, pool, dtype):
    x, wt = _conv_inputs(shape, dtype, seed=sum(shape), filter_cl=shape[0] % 2 == 0)
    out, idx, partials = conv_stats_forward(x, wt, True, pool)
    ref = _reference_conv(x, wt)
    where = f"shape={shape} {dtype} pool={pool}"
    assert out.dtype == dtype and out.is_contiguous(memory_format=CL)
    if pool == "before":
        # max is 1-Lipschitz: |max(a) - max(b)| <= max|a - b|, whatever the ties
        assert_close(out, F.max_pool2d(ref.float(), 2), CONV_TOL[dtype], f"pooled conv [{where}]")
        _, _, ho, wo = out.shape
        windows = pool_windows(ref.float())
        assert int(idx.min()) >= 0 and int(idx.max()) <= 3, f"argmax outside 0..3 [{where}]"
        at_idx = windows.gather(-1, idx.long().cpu()[..., None].to(windows.device)).squeeze(-1)
        assert_close(at_idx, out, CONV_TOL[dtype], f"reference value at the argmax [{where}]")
        clear = ~near_tie_windows(ref)[:, :, : 2 * ho : 2, : 2 * wo : 2]  # one flag per window
        assert torch.equal(idx.long()[clear], windows.argmax(-1)[clear]), f"argmax [{where}]"
    else:
        assert idx is None
        assert_close(out, ref, CONV_TOL[dtype], f"conv [{where}]")
    rows = out.numel() // out.shape[1]
    mean, var = _combine(partials, rows)
    vals = out.double().cpu().permute(0, 2, 3, 1).reshape(-1, out.shape[1])
    assert_close(mean, vals.mean(0), 1e-6, f"batch mean [{where}]")
    assert_close(var, vals.var(0, unbiased=False), 1e-6, f"batch variance [{where}]")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("pool", [None, "before"], ids=["nopool", "before"])
def test_several_tiles_per_program_fold_their_statistics(monkeypatch, pool, dtype):
    """Few programs: each walks several tiles (and the last a shorter run), folding each tile's
    mean and M2 into its own (Chan's formula); values far from 0 (mean 300 in fp32, 30 in fp16,
    spread about 1) check the folding does not lose the variance to cancellation."""
    for name in ("LAUNCH", "LAUNCH_FP32"):
        monkeypatch.setattr(cs, name, getattr(cs, name)._replace(programs_per_sm=1))
    monkeypatch.setattr(cs.gpu, "sm_count", lambda device: 2)  # 2 programs in all
    side = 13

    def tiling(n):
        rows = n * (side // 2 if pool else side) ** 2
        return cs.conv_tiling(4, 6, rows, pool is not None, cs.launch_for(dtype), sms=2)[3:]

    # the smallest batch where both programs walk several tiles and the last walks fewer
    n = next(n for n in range(1, 100) if tiling(n)[0] % tiling(n)[1] and tiling(n)[1] > 1 and tiling(n)[2] == 2)
    x, wt = _conv_inputs((n, 4, 6, side, side), dtype, seed=3)
    x = x + (300.0 if dtype == torch.float32 else 30.0)
    out, _, partials = conv_stats_forward(x, wt, True, pool)
    rows = out.numel() // out.shape[1]
    mean, var = _combine(partials, rows)
    vals = out.double().cpu().permute(0, 2, 3, 1).reshape(-1, 6)
    assert_close(mean, vals.mean(0), 1e-6, "batch mean")
    assert_close(var, vals.var(0, unbiased=False), 1e-5, "batch variance")


def _run(fn, x, wt, weight, bias, rm, rv, dy, training, act, pool):
    x = x.clone().requires_grad_()
    wt = wt.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    bias = bias.clone().requires_grad_()
    rm, rv = rm.clone(), rv.clone()
    y = fn(x, wt, weight, bias, rm, rv, training, 0.1, 1e-5, act, pool)
    y.backward(dy)
    return dict(y=y, dx=x.grad, dfilter=wt.grad, dweight=weight.grad, dbias=bias.grad, running_mean=rm, running_var=rv)


def _block_inputs(shape, dtype, seed):
    n, c_in, c_out, h, w = shape
    x, wt = _conv_inputs(shape, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    weight = (torch.rand(c_out, generator=g) + 0.5).to(DEVICE)
    bias = (torch.randn(c_out, generator=g) * 0.3).to(DEVICE)
    rm = (torch.randn(c_out, generator=g) * 0.1).to(DEVICE)
    rv = (torch.rand(c_out, generator=g) + 0.5).to(DEVICE)
    return x, wt, weight, bias, rm, rv, g


def _has_near_ties(x, wt, weight, bias, act, pool) -> bool:
    """Whether a 2x2 window the pool compares has its top two values one dtype step apart or
    closer (or, after a ReLU, its largest input at its kink): there the kernel's and the
    reference's summation orders may pick different maxima, each a correct subgradient, moving a
    whole gradient in the comparison. Pool before: the conv output's windows; pool after: the
    activation's, from the reference batchnorm."""
    conv = _reference_conv(x, wt)
    if pool == "before":
        return bool(near_tie_windows(conv).any())
    pre = F.batch_norm(conv.float(), None, None, weight, bias, True, 0.0, 1e-5).to(x.dtype)
    return bool(near_tie_windows(activation(pre.float(), act).to(x.dtype), pre if act == "relu" else None).any())


def _compare_block(shape, dtype, act, pool, training=True, seed=0):
    n, c_in, c_out, h, w = shape
    for s in range(seed, seed + 50):  # the first case without near ties (_has_near_ties)
        x, wt, weight, bias, rm, rv, g = _block_inputs(shape, dtype, s)
        if pool is None or not _has_near_ties(x, wt, weight, bias, act, pool):
            break
    else:
        raise AssertionError(f"no tie-free case among seeds {seed}..{seed + 49} for {shape} {dtype} {act} {pool}")
    oh, ow = (h // 2, w // 2) if pool else (h, w)
    dy = torch.randn(n, c_out, oh, ow, generator=g).to(dtype).to(DEVICE).contiguous(memory_format=CL)
    ref = _run(conv_bn_act_pool_reference, x, wt, weight, bias, rm, rv, dy, training, act, pool)
    got = _run(conv_bn_act_pool, x, wt, weight, bias, rm, rv, dy, training, act, pool)
    where = f"shape={shape} {dtype} act={act} pool={pool} training={training} seed={s}"
    assert got["y"].is_contiguous(memory_format=CL)
    for k in ref:
        tol = 1e-5 if k.startswith("running") else TOL[dtype]
        assert_close(got[k], ref[k], tol, f"{k} [{where}]")


BLOCK_SHAPES = [(3, 5, 7, 7, 7), (2, 24, 16, 6, 6), (2, 8, 70, 5, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("pool", [None, "before", "after"], ids=["nopool", "before", "after"])
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("shape", BLOCK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_block_training(shape, act, pool, dtype):
    _compare_block(shape, dtype, act, pool, seed=sum(shape))


@pytest.mark.parametrize("pool", [None, "before"], ids=["nopool", "before"])
def test_fused_block_eval_uses_running_stats(pool):
    _compare_block((3, 5, 7, 7, 7), torch.float32, "gelu", pool, training=False, seed=4)


@pytest.mark.parametrize("k", [1, 5])
def test_other_odd_kernels(k):
    x, wt = _conv_inputs((2, 6, 9, 7, 7), torch.float32, k=k, seed=k)
    out, _, _ = conv_stats_forward(x, wt, False, None)
    assert_close(out, _reference_conv(x, wt), CONV_TOL[torch.float32], f"{k}x{k} conv")


def test_launcher_rejections():
    x, wt = _conv_inputs((2, 4, 6, 6, 6), torch.float32)
    cases = [
        (lambda: conv_stats_forward(x.contiguous(), wt, True), ValueError, "channels-last"),
        (lambda: conv_stats_forward(x, wt[:, :, :2, :2].contiguous(), True), ValueError, "odd square"),
        (lambda: conv_stats_forward(x, wt[:, :3].contiguous(), True), ValueError, "input channels"),
        (lambda: conv_stats_forward(x, wt.half(), True), TypeError, "like x"),
        (
            lambda: conv_stats_forward(x[:, :, :1, :1].contiguous(memory_format=CL), wt, True, "before"),
            ValueError,
            "at least 2x2",
        ),
        (lambda: conv_stats_forward(x, wt, True, "middle"), ValueError, "pool must be"),
        (
            lambda: conv_stats_forward(x[:1, :, :1, :1].contiguous(memory_format=CL), wt, True),
            ValueError,
            "more than 1 value",
        ),
    ]
    for call, error, words in cases:
        with pytest.raises(error, match=words):
            call()


def test_the_block_takes_any_layout_as_the_library_conv_does():
    """ResNet-9's first conv runs on the images, which may come in NCHW (an API caller's batch):
    the fused block takes them (the unfused one's Triton normalize block would refuse the conv's
    NCHW output)."""
    torch.manual_seed(0)
    plain = ConvBlock(3, 8, TritonNormActPool, act="gelu").to(DEVICE)
    fused = ConvBlock(3, 8, TritonNormActPool, act="gelu").to(DEVICE)
    fused.load_state_dict(plain.state_dict())
    fused.__class__ = TritonConvBlock
    x = torch.randn(2, 3, 6, 6).to(DEVICE)  # NCHW-contiguous, not channels-last
    assert_close(fused(x), plain(x.contiguous(memory_format=CL)), TOL[torch.float32], "NCHW input")


def test_which_blocks_fuse():
    triton_norm = TritonNormActPool
    assert fusable(ConvBlock(3, 8, triton_norm, pool="before"))
    assert fusable(ConvBlock(3, 8, triton_norm, kernel=5))
    assert not fusable(ConvBlock(3, 8, NormActPool))  # the fused block runs the Triton normalize kernels
    assert not fusable(ConvBlock(3, 8, triton_norm, kernel=11, stride=4))  # AlexNet's first conv
    assert not fusable(ConvBlock(3, 8, per_rank(triton_norm, 2)))  # statistics per emulated rank
    assert not fusable(torch.nn.Conv2d(3, 8, 3, padding=1))


@pytest.mark.slow  # the default network's steps with the fused conv under the interpreter
def test_fused_default_preset_steps_like_the_unfused_one(monkeypatch):
    """The trainer's own path: ``build_model`` with ``--fused-conv`` and the step it trains with
    (``make_step``, the default preset's Muon), against the same without: two steps on the same
    batches give the same losses and weights (fp32). The whitening bias freezes after the first
    step, as the trainer freezes it, so the first block's conv then gets no input gradient in the
    second (its backward skips that half), which also takes the first's momentum. The model file's
    keys are the unfused model's."""
    import dataclasses

    from fastcifar.core.config import from_preset
    from fastcifar.models.network import build_model
    from fastcifar.run.recipe import make_optimizer
    from fastcifar.run.schedule import DeviceSchedule
    from fastcifar.run.step import make_step

    if DEVICE == "cpu":
        monkeypatch.setenv("FASTCIFAR_ALLOW_INTERPRETER", "1")  # the tests' opt-in to Triton's interpreter
        # fp16's larger tiles for fp32 (registers do not matter to the interpreter): it runs the
        # programs one by one, and fp32's own tiles took this test from 15 to 42 s on 2 cores
        monkeypatch.setattr(cs, "LAUNCH_FP32", cs.LAUNCH)
    device = torch.device(DEVICE)
    cfg = from_preset(widths=(8, 16, 16), kernels="triton")
    g = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randn(4, 3, 32, 32, generator=g).to(device).contiguous(memory_format=CL),
            torch.randint(0, 10, (4,), generator=g).to(device),
        )
        for _ in range(2)
    ]
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = build_model(dataclasses.replace(cfg, fused_conv=fused), device, torch.float32)
        start = {k: v.clone() for k, v in model.state_dict().items()}
        assert sum(isinstance(m, TritonConvBlock) for m in model.modules()) == (6 if fused else 0)
        step = make_step(
            model,
            make_optimizer(model, cfg, 4, peak=0.01),
            DeviceSchedule([0.01, 0.008], device),
            cfg.label_smoothing,
        )
        losses = []
        for i, (images, labels) in enumerate(batches):
            model.whiten.bias.requires_grad_(i == 0)
            losses.append(float(step(images, labels)[0]))
        results.append((losses, start, model.state_dict()))
    (plain_losses, start, plain), (fused_losses, fused_start, fused) = results
    assert fused.keys() == plain.keys()
    assert all(torch.equal(fused_start[k], start[k]) for k in start), "the same initial state"
    assert_close(torch.tensor(fused_losses), torch.tensor(plain_losses), 1e-5, "losses")
    # what the two steps moved each tensor, not its value: some batchnorm biases move only 3e-5,
    # so a value tolerance would pass a fused block that left them still; the two paths' moves
    # differ by at most 1e-6 here (2 cores, interpreter)
    for name, a in plain.items():
        if a.is_floating_point():
            assert_close(fused[name] - start[name], a - start[name], 1e-5, f"{name}'s move in two steps")


@pytest.mark.cuda
@pytest.mark.parametrize("conv", kernel_registers.DEFAULT_CONVS, ids=lambda c: f"{c[1]}-{c[2]}-{c[3]}x{c[3]}-{c[4]}")
def test_default_preset_convs_fp16_cuda(conv):
    """The default preset's six convs at full size on the GPU (about 1000 programs each walking
    several tiles, 31x31 odd maps, up to 4 channel blocks): the conv output or its pool against
    fp32 F.conv2d rounded once, the argmax's value, and the statistics from the partials in float64
    against the written values. Gradients are the normalize block's and cuDNN's, tested elsewhere."""
    n, c_in, c_out, side, pool = conv
    x, wt = _conv_inputs((n, c_in, c_out, side, side), torch.float16, seed=side, filter_cl=True)
    out, idx, partials = conv_stats_forward(x, wt, True, pool)
    ref = _reference_conv(x, wt)
    where = f"{conv}"
    if pool == "before":
        assert_close(out, F.max_pool2d(ref.float(), 2), CONV_TOL[torch.float16], f"pooled conv [{where}]")
        at_idx = pool_windows(ref).gather(-1, idx.long()[..., None]).squeeze(-1)
        assert_close(at_idx, out, CONV_TOL[torch.float16], f"reference value at the argmax [{where}]")
    else:
        assert_close(out, ref, CONV_TOL[torch.float16], f"conv [{where}]")
    rows = out.numel() // out.shape[1]
    mean, var = _combine(partials, rows)
    vals = out.double().permute(0, 2, 3, 1).reshape(-1, out.shape[1]).cpu()
    assert_close(mean, vals.mean(0), 1e-5, f"batch mean [{where}]")
    assert_close(var, vals.var(0, unbiased=False), 1e-5, f"batch variance [{where}]")
