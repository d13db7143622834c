"""kernels/bn_act_pool.py against bn_act_pool_reference / NormActPool: outputs, every gradient,
running statistics, eval mode, odd shapes, ResNet-9 shapes, launcher rejections, a few training steps.

Runs under TRITON_INTERPRET=1 when there is no GPU (set below, before triton is imported), on the
GPU otherwise. Shapes are small so that the whole file takes seconds on 2 CPU cores.
"""

import pytest  # noqa: E402
import torch
import torch.nn.functional as F
from _kernel_asserts import (
    DEVICE,
    assert_close,
    near_tie_windows,
    needs_triton_backend,  # noqa: E402
    poisoned_empty,
)

import fastcifar.kernels.bn_act_pool as bap  # noqa: E402
import fastcifar.kernels.checks as checks  # noqa: E402
from bench import kernel_registers  # noqa: E402
from fastcifar.kernels.bn_act_pool import (  # noqa: E402
    TritonNormActPool,
    bn_act_pool,
    bn_act_pool_backward,
    bn_act_pool_forward,
)
from fastcifar.models.resnet9 import ResNet9
from fastcifar.ops.norm_act_pool import (  # noqa: E402
    NormActPool,
    activation,
    bn_act_pool_reference,
    bn_act_pool_reference_with_stats,
    bn_reference_with_stats,
)

pytestmark = needs_triton_backend

# fp32: the kernel and eager differ only in summation order. fp16: eager rounds the activation's
# gradient to fp16 before the batchnorm backward; the kernel keeps it fp32 (a few fp16 ulps apart).
TOL = {torch.float32: 3e-5, torch.float16: 1e-2}
CL = torch.channels_last


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Every buffer the launchers allocate starts as NaN (int8 argmax as -1)."""
    monkeypatch.setattr(bap, "_empty", poisoned_empty(bap._empty))


def _inputs(shape, dtype, seed=0, out_pool=None):
    g = torch.Generator().manual_seed(seed)
    n, c, h, w = shape
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype).to(DEVICE).contiguous(memory_format=CL)
    weight = (torch.rand(c, generator=g) + 0.5).to(DEVICE)
    bias = (torch.randn(c, generator=g) * 0.3).to(DEVICE)
    rm = (torch.randn(c, generator=g) * 0.1).to(DEVICE)
    rv = (torch.rand(c, generator=g) + 0.5).to(DEVICE)
    oh, ow = (h // 2, w // 2) if out_pool else (h, w)
    dy = torch.randn((n, c, oh, ow), generator=g).to(dtype).to(DEVICE).contiguous(memory_format=CL)
    return x, weight, bias, rm, rv, dy


def _run(fn, x, weight, bias, rm, rv, dy, training, act, pool, momentum=0.1, eps=1e-5):
    x = x.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    bias = bias.clone().requires_grad_()
    rm, rv = rm.clone(), rv.clone()
    y = fn(x, weight, bias, rm, rv, training, momentum, eps, act, pool)
    y.backward(dy)
    return dict(y=y, dx=x.grad, dweight=weight.grad, dbias=bias.grad, running_mean=rm, running_var=rv)


def _compare(shape, dtype, act, pool, training=True, seed=0):
    x, weight, bias, rm, rv, dy = _inputs(shape, dtype, seed, out_pool=pool)
    ref = _run(bn_act_pool_reference, x, weight, bias, rm, rv, dy, training, act, pool)
    got = _run(bn_act_pool, x, weight, bias, rm, rv, dy, training, act, pool)
    where = f"shape={shape} {dtype} act={act} pool={pool} training={training}"
    assert got["y"].dtype == dtype and got["dx"].dtype == dtype
    assert got["y"].is_contiguous(memory_format=CL) and got["dx"].is_contiguous(memory_format=CL)
    for k in ref:
        # running stats are fp32 sums of fp32-converted inputs in both paths: tight even for fp16
        tol = 1e-5 if k.startswith("running") else TOL[dtype]
        assert_close(got[k], ref[k], tol, f"{k} [{where}]")


ODD_SHAPES = [(1, 5, 6, 6), (3, 5, 7, 7), (3, 24, 6, 6), (1, 24, 7, 7), (3, 24, 7, 6)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("pool", [None, "before", "after"], ids=["nopool", "before", "after"])
@pytest.mark.parametrize("act", ["relu", "gelu", "celu"])
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_training_odd_shapes(shape, act, pool, dtype):
    _compare(shape, dtype, act, pool)


# SiLU (--activation silu) on one odd shape only: the interpreter costs ~1.5 s a case on CI's 2 cores
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("pool", [None, "before", "after"], ids=["nopool", "before", "after"])
def test_training_silu(pool, dtype):
    _compare((3, 5, 7, 7), dtype, "silu", pool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("pool", [None, "before", "after"], ids=["nopool", "before", "after"])
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("shape", [(3, 5, 7, 7), (1, 24, 6, 6)], ids=lambda s: "x".join(map(str, s)))
def test_eval_mode_uses_running_stats(shape, act, pool, dtype):
    _compare(shape, dtype, act, pool, training=False)


# The seed ResNet-9's blocks (channels, map, pool) at batch 2, and the fast recipes' pool-before-BN.
RESNET9_BLOCKS = [
    (64, 32, None),
    (128, 32, "after"),
    (128, 16, None),
    (256, 16, "after"),
    (512, 8, "after"),
    (512, 4, None),
    (128, 32, "before"),
    (256, 16, "before"),
    (512, 8, "before"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block", RESNET9_BLOCKS, ids=lambda b: f"c{b[0]}-{b[1]}x{b[1]}-{b[2]}")
@pytest.mark.slow  # every ResNet-9 block shape under the Triton interpreter
def test_resnet9_shapes(block, dtype):
    c, hw, pool = block
    _compare((2, c, hw, hw), dtype, "relu", pool, seed=c + hw)


def test_bfloat16_smoke():
    x, weight, bias, rm, rv, dy = _inputs((3, 24, 6, 6), torch.bfloat16, out_pool=None)
    ref = _run(bn_act_pool_reference, x, weight, bias, rm, rv, dy, True, "relu", None)
    got = _run(bn_act_pool, x, weight, bias, rm, rv, dy, True, "relu", None)
    for k in ref:
        assert_close(got[k], ref[k], 5e-2, f"{k} [bf16]")


def test_large_mean_small_variance_fp16():
    """Statistics from sums shifted by a pivot from the data: channels at 1500 +- 4 in fp16 keep their
    variance (unshifted sums in fp32, E[x^2] - E[x]^2, lose 4% of it here: x^2 ~ 2e6 carries an
    absolute error of ~0.1 per term)."""
    g = torch.Generator().manual_seed(3)
    x = (1500 + 4 * torch.randn((3, 24, 7, 7), generator=g)).half().to(DEVICE).contiguous(memory_format=CL)
    c = 24
    w, b = torch.ones(c, device=DEVICE), torch.zeros(c, device=DEVICE)
    rm_ref, rv_ref = torch.zeros(c, device=DEVICE), torch.ones(c, device=DEVICE)
    rm, rv = rm_ref.clone(), rv_ref.clone()
    xf = x.float()
    y_ref = bn_act_pool_reference(xf, w, b, rm_ref, rv_ref, True, 1.0, 1e-5, "relu", None)
    y = bn_act_pool(x, w, b, rm, rv, True, 1.0, 1e-5, "relu", None)
    assert_close(rv, rv_ref, 1e-4, "running_var at mean 1500")
    assert_close(y, y_ref, 1e-2, "y at mean 1500")


def test_running_stats_momentum_and_batches_tracked():
    torch.manual_seed(0)
    ref = NormActPool(24, act="relu", pool="after", momentum=0.3).to(DEVICE)
    mod = TritonNormActPool(24, act="relu", pool="after", momentum=0.3).to(DEVICE)
    assert list(mod.state_dict().keys()) == list(ref.state_dict().keys())
    mod.load_state_dict(ref.state_dict())
    for step in range(3):
        x = torch.randn(3, 24, 7, 7, device=DEVICE).contiguous(memory_format=CL)
        assert_close(mod(x), ref(x), 3e-5, f"y step {step}")
        assert_close(mod.running_mean, ref.running_mean, 1e-5, f"running_mean step {step}")
        assert_close(mod.running_var, ref.running_var, 1e-5, f"running_var step {step}")
    assert int(mod.num_batches_tracked) == 3
    mod.eval()
    ref.eval()
    x = torch.randn(3, 24, 7, 7, device=DEVICE).contiguous(memory_format=CL)
    assert_close(mod(x), ref(x), 3e-5, "y eval")
    assert int(mod.num_batches_tracked) == 3


@pytest.mark.parametrize("norm", [NormActPool, TritonNormActPool], ids=["torch", "triton"])
def test_momentum_none_is_cumulative_average(norm):
    """momentum=None as nn.BatchNorm2d's: both kernel paths (the plain one used to pass None to
    F.batch_norm and raise a TypeError)."""
    mod = norm(5, momentum=None).to(DEVICE)
    ref = torch.nn.BatchNorm2d(5, momentum=None).to(DEVICE)
    for _ in range(3):
        x = torch.randn(3, 5, 6, 6, device=DEVICE).contiguous(memory_format=CL)
        mod(x)
        ref(x)
    assert int(mod.num_batches_tracked) == 3
    assert_close(mod.running_mean, ref.running_mean, 1e-5, "running_mean (cumulative)")
    assert_close(mod.running_var, ref.running_var, 1e-5, "running_var (cumulative)")


def test_emulated_ranks_run_the_triton_block_once_per_rank():
    """--emulate-ranks with --kernels triton: the per-rank block (ops.norm_act_pool.per_rank) calls
    the kernel on each rank's chunk, with that rank's running statistics a row of a (ranks, C)
    table: outputs, every gradient and the running statistics as the per-rank torch block's."""
    from fastcifar.ops.norm_act_pool import per_rank

    torch.manual_seed(0)
    ref = per_rank(NormActPool, 3)(5, act="gelu", pool="before", momentum=0.4).to(DEVICE)
    mod = per_rank(TritonNormActPool, 3)(5, act="gelu", pool="before", momentum=0.4).to(DEVICE)
    mod.load_state_dict(ref.state_dict())
    for step in range(2):
        # the ranks' chunks are shifted apart: one batchnorm over all 6 images would differ
        x = torch.randn(6, 5, 6, 6, device=DEVICE) + torch.arange(6.0, device=DEVICE).view(6, 1, 1, 1) * 2
        dy = torch.randn(6, 5, 3, 3, device=DEVICE).contiguous(memory_format=CL)
        got = []
        for m in (ref, mod):
            xx = x.contiguous(memory_format=CL).requires_grad_()
            m.zero_grad()
            y = m(xx)
            y.backward(dy)
            got.append(
                dict(
                    y=y,
                    dx=xx.grad,
                    dweight=m.weight.grad,
                    dbias=m.bias.grad,
                    running_mean=m.running_mean.clone(),
                    running_var=m.running_var.clone(),
                )
            )
        for k in got[0]:
            assert_close(
                got[1][k], got[0][k], 1e-5 if k.startswith("running") else TOL[torch.float32], f"{k} step {step}"
            )
    assert int(mod.num_batches_tracked) == 2


def test_foreign_gradient_layout():
    """A gradient that is not channels-last (the expanded one of .sum()) still gives the right result."""
    x, weight, bias, rm, rv, _ = _inputs((3, 5, 7, 7), torch.float32, out_pool="after")
    grads = []
    for fn in (bn_act_pool_reference, bn_act_pool):
        xx = x.clone().requires_grad_()
        (fn(xx, weight, bias, rm.clone(), rv.clone(), True, 0.1, 1e-5, "gelu", "after") ** 2).sum().backward()
        grads.append(xx.grad)
    assert_close(grads[1], grads[0], 3e-5, "dx with a contiguous (NCHW) incoming gradient")


def _good():
    x = torch.randn(3, 5, 6, 6, device=DEVICE).contiguous(memory_format=CL)
    vec = lambda: torch.ones(5, device=DEVICE)  # noqa: E731
    return dict(x=x, weight=vec(), bias=vec(), running_mean=vec(), running_var=vec())


@pytest.mark.parametrize(
    "case, error, message",
    [
        ("nchw", ValueError, "channels-last"),
        ("3d", ValueError, "4-D"),
        ("fp64", TypeError, "float64"),
        ("int", TypeError, "int32"),
        ("sliced", ValueError, "channels-last"),
        ("weight_fp16", ValueError, "weight must be a contiguous fp32"),
        ("bias_shape", ValueError, "bias must be a contiguous fp32 tensor of shape (5,)"),
        ("no_var", ValueError, "running_var is required"),
        ("pool_1x1", ValueError, "at least 2x2"),
        ("one_value", ValueError, "more than 1 value per channel"),
        ("act", ValueError, "unknown activation"),
        ("pool", ValueError, "pool must be one of"),
    ],
)
def test_launcher_rejects(case, error, message):
    a = _good()
    kw = dict(training=True, momentum=0.1, eps=1e-5, act="relu", pool=None)
    if case == "nchw":
        a["x"] = a["x"].contiguous()
    elif case == "3d":
        a["x"] = a["x"][0]
    elif case == "fp64":
        a["x"] = a["x"].double()
    elif case == "int":
        a["x"] = a["x"].int()
    elif case == "sliced":
        a["x"] = torch.randn(3, 10, 6, 6, device=DEVICE).contiguous(memory_format=CL)[:, ::2]
    elif case == "weight_fp16":
        a["weight"] = a["weight"].half()
    elif case == "bias_shape":
        a["bias"] = torch.ones(6, device=DEVICE)
    elif case == "no_var":
        a["running_var"] = None
    elif case == "pool_1x1":
        a["x"] = torch.randn(3, 5, 1, 1, device=DEVICE).contiguous(memory_format=CL)
        kw["pool"] = "after"
    elif case == "one_value":
        a["x"] = torch.randn(1, 5, 2, 2, device=DEVICE).contiguous(memory_format=CL)
        kw["pool"] = "before"
    elif case == "act":
        kw["act"] = "tanh"
    elif case == "pool":
        kw["pool"] = "around"
    with pytest.raises(error) as info:
        bn_act_pool_forward(**a, **kw)
    assert message in str(info.value), str(info.value)


def test_backward_launcher_rejects_wrong_dy():
    a = _good()
    y, saved = bn_act_pool_forward(**a, training=True, momentum=0.1, eps=1e-5, act="relu", pool="after")
    with pytest.raises(ValueError, match="dy must have shape"):
        bn_act_pool_backward(
            torch.ones_like(a["x"]), saved, a["weight"], a["bias"], a["x"].shape, True, "relu", "after"
        )
    with pytest.raises(TypeError, match="dy must be"):
        bn_act_pool_backward(y.half(), saved, a["weight"], a["bias"], a["x"].shape, True, "relu", "after")
    with pytest.raises(ValueError, match="channels-last"):
        bn_act_pool_backward(y.contiguous(), saved, a["weight"], a["bias"], a["x"].shape, True, "relu", "after")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors are fine under the interpreter only")
def test_cpu_tensor_rejected_without_interpreter(monkeypatch):
    monkeypatch.setattr(checks, "interpreted", lambda: False)
    with pytest.raises(ValueError, match="need a CUDA tensor"):
        bap.check_activation(_good()["x"])


def _model(norm, state):
    model = ResNet9(norm=norm, widths=(8, 16, 16, 32)).to(DEVICE).to(memory_format=CL)
    model.load_state_dict(state)
    return model


def _train(model, batches):
    """SGD steps over ``batches``: each step's loss, and the first step's gradients (before its update)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=5e-4)
    losses, first_grads = [], None
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if first_grads is None:
            first_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, first_grads


@pytest.mark.slow  # trains ResNet-9 steps under the Triton interpreter and in torch
def test_resnet9_trains_like_torch_path():
    """ResNet9(norm=TritonNormActPool) from NormActPool's init: same first-step gradients (fp32, every
    parameter), then the same loss curve over 4 SGD steps. The curve tolerance is looser (1e-3) than
    the gradients' because training amplifies the ~1e-6 summation-order differences step by step
    (measured on CPU: ~2e-6 relative on every gradient of step 1)."""
    torch.manual_seed(0)
    state = ResNet9(widths=(8, 16, 16, 32)).state_dict()
    g = torch.Generator().manual_seed(1)
    # one batch seen 4 times: the model memorizes it, so the loss must fall; 4 images, as the
    # interpreter's time grows with the rows (8 took this test 40 s on 2 cores)
    batch = (
        torch.randn(4, 3, 32, 32, generator=g).to(DEVICE).contiguous(memory_format=CL),
        torch.randint(0, 10, (4,), generator=g).to(DEVICE),
    )
    batches = [batch] * 4

    ref_model, model = _model(NormActPool, state), _model(TritonNormActPool, state)
    (ref_losses, ref_grads), (losses, grads) = _train(ref_model, batches), _train(model, batches)
    for k, ref in ref_grads.items():
        assert_close(grads[k], ref, 1e-4, f"step-1 gradient of {k}", rtol=1e-3)
    assert ref_losses[-1] < ref_losses[0], f"the reference itself did not learn: {ref_losses}"
    for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) <= 1e-3 * abs(b), (
            f"loss at step {i}: triton {a:.7f} vs torch {b:.7f}; curves {losses} vs {ref_losses}"
        )
    ref_state = ref_model.state_dict()
    for k, v in model.state_dict().items():
        if k.endswith("num_batches_tracked"):  # both count in NormActPool.step_momentum
            assert int(v) == 4 and int(ref_state[k]) == 4, (
                f"{k} = {int(v)} (triton) / {int(ref_state[k])} (torch) after 4 steps"
            )
            continue
        assert_close(v, ref_state[k], 1e-3, f"{k} after 4 steps")


def _compare_own_stats(shape, dtype, act, pool, seed=0, tol=None):
    """The kernel against ``bn_act_pool_reference_with_stats`` fed the kernel's own mean/rstd: the
    ReLU masks and 2x2 argmaxes must agree exactly, so ``y`` and every gradient are within ``TOL``.
    Those statistics are themselves checked against float64 ones of the normalized input (so a wrong
    batch mean/var cannot pass by being fed to both sides), and so are the running statistics."""
    x, weight, bias, rm, rv, dy = _inputs(shape, dtype, seed, out_pool=pool)
    momentum, eps = 0.1, 1e-5
    _, (_, _, mean, rstd) = bn_act_pool_forward(x, weight, bias, rm.clone(), rv.clone(), True, momentum, eps, act, pool)
    where = f"shape={shape} {dtype} act={act} pool={pool}"
    # the max-pool is exact in any dtype, so pooling before the float64 cast is the kernel's input
    normed = (F.max_pool2d(x, 2) if pool == "before" else x).double()
    count = normed.numel() // normed.shape[1]
    mean64 = normed.mean(dim=(0, 2, 3))
    var64 = normed.var(dim=(0, 2, 3), unbiased=False)
    # fp32 two-stage shifted sums over <= 1M values per channel are good to a few 1e-7 relative; 1e-5
    # keeps a wide margin while a skipped tile or a biased/unbiased mix-up moves them by far more
    assert_close(mean, mean64, 1e-5, f"batch mean vs float64 [{where}]")
    assert_close(rstd, torch.rsqrt(var64 + eps), 1e-5, f"batch rstd vs float64 [{where}]")

    def with_stats(x, weight, bias, rm, rv, training, momentum, eps, act, pool):
        return bn_act_pool_reference_with_stats(x, weight, bias, mean, rstd, act, pool, eps=eps)

    ref = _run(with_stats, x, weight, bias, rm, rv, dy, True, act, pool)
    got = _run(bn_act_pool, x, weight, bias, rm, rv, dy, True, act, pool)
    if pool == "after" and x.is_cuda:  # fused multiply-add may break near-ties the other way (near_tie_windows)
        with torch.no_grad():
            pre = bn_reference_with_stats(x, weight, bias, mean, rstd, eps)  # for the ReLU's kink
            ties = near_tie_windows(activation(pre, act), pre if act == "relu" else None)
        assert float(ties.float().mean()) < 1e-2, (
            f"{float(ties.float().mean()):.2%} of dx exempt as near-ties [{where}]"
        )
        got["dx"], ref["dx"] = got["dx"][~ties], ref["dx"][~ties]
    for k in ("y", "dx", "dweight", "dbias"):
        assert_close(got[k], ref[k], tol or TOL[dtype], f"{k} [{where} (kernel's own statistics)]")
    # running statistics: momentum update with the float64 batch mean and unbiased variance
    assert_close(got["running_mean"], (1 - momentum) * rm.double() + momentum * mean64, 1e-5, f"running_mean [{where}]")
    assert_close(
        got["running_var"],
        (1 - momentum) * rv.double() + momentum * var64 * count / (count - 1),
        1e-5,
        f"running_var [{where}]",
    )


# 1e-12: `fast`'s bn_eps; 0.5: large enough that a gradient path ignoring ``eps`` fails the check
@pytest.mark.parametrize("eps", [1e-5, 1e-12, 0.5])
def test_reference_with_stats_is_batchnorm_when_given_the_batchs_statistics(eps):
    """Fed the batch's own fp32 statistics, the straight-through reference is the eager reference,
    forward and backward (fp32, tight): its gradient does flow through the mean and variance."""
    x, weight, bias, rm, rv, dy = _inputs((3, 5, 6, 6), torch.float32, out_pool="after")
    mean = x.float().mean(dim=(0, 2, 3))
    rstd = torch.rsqrt(x.float().var(dim=(0, 2, 3), unbiased=False) + eps)

    def with_stats(x, weight, bias, rm, rv, training, momentum, eps, act, pool):
        return bn_act_pool_reference_with_stats(x, weight, bias, mean, rstd, act, pool, eps=eps)

    ref = _run(bn_act_pool_reference, x, weight, bias, rm, rv, dy, True, "gelu", "after", eps=eps)
    got = _run(with_stats, x, weight, bias, rm, rv, dy, True, "gelu", "after", eps=eps)
    for k in ("y", "dx", "dweight", "dbias"):
        assert_close(got[k], ref[k], 1e-5, f"{k} (straight-through reference, eps={eps})")


def test_near_tie_windows_marks_only_windows_whose_top_two_are_a_step_apart():
    """The exemption the CUDA comparison grants: whole windows with a tie or a one-ulp near-tie,
    never a window with a clear winner, never the row/column the pool drops."""
    one = 1.0
    ulp = torch.finfo(torch.float16).eps  # at 1.0
    a = torch.tensor(
        [
            [one, one, 0.2, 0.9, 0.0],  # window 0: tie; window 1: clear winner
            [0.5, 0.1, 0.3, 0.1, 0.0],
            [one + ulp, 0.0, 3.0, 3.0 - 4 * ulp, 0.0],  # window 2: one ulp apart; window 3: two ulps (2^-9) apart
            [one, 0.3, 0.1, 0.2, 0.0],
            [9.0, 9.0, 9.0, 9.0, 9.0],
        ],
        dtype=torch.float16,
    ).view(1, 1, 5, 5)
    mask = near_tie_windows(a)[0, 0]
    assert mask[:2, :2].all() and not mask[:2, 2:4].any()
    assert mask[2:4, :2].all() and not mask[2:4, 2:4].any()
    assert not mask[4].any() and not mask[:, 4].any()  # dropped by the 2x2 pool, ties or not
    assert not near_tie_windows(torch.zeros(1, 1, 2, 2, dtype=torch.float16)).any()  # ReLU zeros: dx 0 anyway


def test_near_tie_windows_marks_a_relu_winner_at_its_kink():
    """With the ReLU's input given: a window whose largest input is within fp16's smallest normal
    (6.1e-5) of 0 is marked, whether it came out a tiny positive winner or all zeros; a window
    whose largest input is clearly negative (all zeros, gradient 0 either way) or clearly positive
    is not."""
    tiny = torch.finfo(torch.float16).tiny
    pre = torch.tensor(
        [[tiny / 2, -0.5, -tiny, -0.3, -0.01, -0.5, 0.7, -0.2], [-0.1, -0.2, -0.4, -0.9, -0.02, -0.5, 0.1, 0.3]],
        dtype=torch.float16,
    ).view(1, 1, 2, 8)
    mask = near_tie_windows(torch.relu(pre), pre)[0, 0]
    assert mask[:, 0:2].all() and mask[:, 2:4].all()  # a tiny positive winner; all zeros from -tiny
    assert not mask[:, 4:6].any() and not mask[:, 6:8].any()  # -0.01: clearly off; 0.7: clearly on
    assert not near_tie_windows(torch.relu(pre))[0, 0, :, 0:4].any()  # without ``pre``: not marked


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_near_tie_exemption_stays_rare_on_the_tests_inputs(act):
    """The CUDA comparison (_compare_own_stats) asserts the exempt share is under 1%; on CPU it is
    not applied, so check here that the tests' own inputs leave it far below that (a first version
    counted all-zero ReLU windows as ties: 8.6% at 512x256x16x16)."""
    x, weight, bias, *_ = _inputs((16, 32, 16, 16), torch.float16, 0, out_pool="after")
    mean = x.float().mean(dim=(0, 2, 3))
    rstd = torch.rsqrt(x.float().var(dim=(0, 2, 3), unbiased=False) + 1e-5)
    with torch.no_grad():
        a = bn_act_pool_reference_with_stats(x, weight, bias, mean, rstd, act, None)
    share = float(near_tie_windows(a).float().mean())
    assert share < 2e-3, f"{share:.3%} of the elements would be exempt"


@pytest.mark.parametrize("pool", [None, "before", "after"], ids=["nopool", "before", "after"])
def test_own_stats_reference_odd_shape_fp16(pool):
    _compare_own_stats((3, 24, 7, 7), torch.float16, "relu", pool, seed=5)


# The presets' real blocks on one GPU, from the lists the compile sweep uses (one place to change):
# resnet9 (ReLU) at 512, fast (GELU; FastNet 64/256/256 after the 2x2 whitening conv: 31x31 maps)
# at 1024.
@pytest.mark.cuda
@pytest.mark.parametrize(
    "block", list(dict.fromkeys(kernel_registers.PRESET_BLOCKS)), ids=lambda b: f"{b[0]}x{b[1]}x{b[2]}-{b[3]}-{b[4]}"
)
def test_preset_shapes_fp16_cuda(block):
    """Full-size shapes (int32 overflow of element offsets, many stage-1 chunks) on the GPU, against
    the reference that uses the kernel's own statistics: cuDNN's batchnorm sums in another order,
    so eager fp16 would flip ~1e-4 of the ReLU masks / argmaxes and fail ``dx`` for the wrong reason."""
    n, c, side, act, pool = block
    _compare_own_stats((n, c, side, side), torch.float16, act, pool)


@pytest.mark.cuda
@pytest.mark.parametrize("pool", [None, "before", "after"], ids=["nopool", "before", "after"])
def test_resnet9_shapes_batch512_fp16_cuda_vs_cudnn_bounded(pool):
    """Against eager cuDNN itself: ``y`` and the parameter gradients within TOL, and ``dx`` off by
    more than TOL in at most 1e-3 of its elements (the mask/argmax flips described above)."""
    shape, dtype = (512, 64 if pool is None else 128, 32, 32), torch.float16
    x, weight, bias, rm, rv, dy = _inputs(shape, dtype, 0, out_pool=pool)
    ref = _run(bn_act_pool_reference, x, weight, bias, rm, rv, dy, True, "relu", pool)
    got = _run(bn_act_pool, x, weight, bias, rm, rv, dy, True, "relu", pool)
    for k in ("y", "dweight", "dbias", "running_mean", "running_var"):
        assert_close(got[k], ref[k], 1e-5 if k.startswith("running") else TOL[dtype], f"{k} vs cuDNN")
    err = (got["dx"].float() - ref["dx"].float()).abs()
    bad = int((err > TOL[dtype] * max(1.0, float(ref["dx"].abs().max()))).sum())
    assert bad <= 1e-3 * err.numel(), f"dx: {bad}/{err.numel()} elements out of tolerance vs cuDNN"
