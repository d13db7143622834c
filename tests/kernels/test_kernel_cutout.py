"""bench/cutout.py against cutout_reference: output and gradient, odd shapes, clipping at the
border, NaN-poisoned outputs, launcher rejections. Interpreter on CPU, the GPU when there is one."""

import pytest  # noqa: E402
import torch
from _kernel_asserts import DEVICE, assert_close, needs_triton_backend, poisoned_empty  # noqa: E402

import bench.cutout as cm  # noqa: E402
from bench.cutout import Cutout, cutout, cutout_forward  # noqa: E402
from fastcifar.ops.augment import cutout_reference  # noqa: E402

pytestmark = needs_triton_backend
CL = torch.channels_last


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(cm, "_empty_like", poisoned_empty(cm._empty_like))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize(
    "shape, size",
    [((1, 5, 7, 7), 3), ((3, 24, 6, 6), 4), ((3, 3, 32, 32), 8), ((2, 64, 32, 32), 12), ((3, 5, 7, 7), 0)],
)
def test_forward_backward_match_reference(shape, size, dtype):
    g = torch.Generator().manual_seed(sum(shape) + size)
    n, c, h, w = shape
    # positions up to h-1 so squares also hang over the bottom/right border (the kernel clips)
    cy = torch.randint(0, h, (n,), generator=g).to(DEVICE)
    cx = torch.randint(0, w, (n,), generator=g).to(DEVICE)
    x = torch.randn(shape, generator=g).to(dtype).to(DEVICE).contiguous(memory_format=CL)
    dy = torch.randn(shape, generator=g).to(dtype).to(DEVICE).contiguous(memory_format=CL)
    outs = []
    for fn in (cutout_reference, cutout):
        xx = x.clone().requires_grad_()
        y = fn(xx, cy, cx, size)
        y.backward(dy)
        outs.append((y, xx.grad))
    (y_ref, dx_ref), (y, dx) = outs
    assert y.dtype == dtype and y.is_contiguous(memory_format=CL)
    assert_close(y, y_ref, 0.0, f"cutout output {shape} size={size} {dtype}")  # exact: a copy or a zero
    assert_close(dx, dx_ref, 0.0, f"cutout gradient {shape} size={size} {dtype}")


def test_module_and_int32_positions():
    x = torch.randn(3, 5, 7, 7, device=DEVICE).contiguous(memory_format=CL)
    cy = torch.tensor([0, 3, 6], dtype=torch.int32, device=DEVICE)
    cx = torch.tensor([6, 0, 2], dtype=torch.int32, device=DEVICE)
    assert_close(Cutout(3)(x, cy, cx), cutout_reference(x, cy.long(), cx.long(), 3), 0.0, "Cutout module, int32")


@pytest.mark.parametrize(
    "case, error, message",
    [
        ("nchw", ValueError, "channels-last"),
        ("uint8", TypeError, "uint8"),
        ("cy_len", ValueError, "cy must have shape (3,)"),
        ("cx_float", TypeError, "cx must be int32 or int64"),
        ("size", ValueError, "non-negative int"),
    ],
)
def test_launcher_rejects(case, error, message):
    x = torch.randn(3, 5, 7, 7, device=DEVICE).contiguous(memory_format=CL)
    cy = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    cx = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    size = 2
    if case == "nchw":
        x = x.contiguous()
    elif case == "uint8":
        x = x.to(torch.uint8).contiguous(memory_format=CL)
    elif case == "cy_len":
        cy = cy[:2]
    elif case == "cx_float":
        cx = cx.float()
    elif case == "size":
        size = -1
    with pytest.raises(error) as info:
        cutout_forward(x, cy, cx, size)
    assert message in str(info.value), str(info.value)
