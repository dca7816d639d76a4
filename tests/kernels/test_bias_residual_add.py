"""bias_residual_add against `(residual + residual_bias) + (x + bias)` computed in fp32 from the same
(upcast) inputs, over SD shapes, dtypes, both memory formats of x and of the residual, and in place."""
import pytest
import torch

from sd_accel.kernels import _triton
from sd_accel.kernels.bias_residual_add import bias_residual_add, bias_residual_add_reference, eligible

CL = torch.channels_last

# SD ResBlock outputs with the spatial size scaled down for the interpreter, plus odd cases
SHAPES = [
    pytest.param((2, 320, 8, 8), id="sd15-320"),
    pytest.param((2, 640, 4, 4), id="sd15-640"),
    pytest.param((1, 1280, 2, 2), id="sd15-1280"),
    pytest.param((1, 960, 6, 5), id="odd-hw"),
    pytest.param((2, 3, 5, 7), id="odd-c3"),
    pytest.param((1, 64, 45, 45), id="many-tiles"),
    pytest.param((3, 96, 1, 1), id="hw1"),
    pytest.param((2, 160, 7), id="ncl-odd-L"),
]
DTYPES = [
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.float16, 2e-3, 2e-3, id="fp16"),
    pytest.param(torch.bfloat16, 1e-2, 1e-2, id="bf16"),
]


def _inputs(shape, dtype, device, x_cl=False, r_cl=False, b_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = shape[1]
    x = (torch.randn(shape, generator=g) * 2).to(device=device, dtype=dtype)
    r = (torch.randn(shape, generator=g) * 3 + 1).to(device=device, dtype=dtype)
    if x_cl:
        x = x.contiguous(memory_format=CL)
    if r_cl:
        r = r.contiguous(memory_format=CL)
    b = torch.randn(C, generator=g).to(device=device, dtype=b_dtype or dtype)
    rb = torch.randn(C, generator=g).to(device=device, dtype=b_dtype or dtype)
    return x, r, b, rb


def _fp32_reference(x, r, b=None, rb=None):
    up = lambda t: None if t is None else t.float()   # noqa: E731
    return bias_residual_add_reference(x.float(), r.float(), up(b), up(rb))


def _check(y, x, ref, atol, rtol):
    assert bias_residual_add.last_call.path == "triton", bias_residual_add.last_call.reason
    assert y.dtype == x.dtype and y.shape == x.shape and y.stride() == x.stride()
    assert not torch.isnan(y).any()
    torch.testing.assert_close(y.float(), ref, atol=atol, rtol=rtol)


LAYOUTS = [pytest.param(p.values[0], False, False, id=p.id + "-nchw") for p in SHAPES] + [
    pytest.param(p.values[0], True, True, id=p.id + "-cl") for p in SHAPES if len(p.values[0]) == 4]


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("shape, x_cl, r_cl", LAYOUTS)
def test_bias_residual_add(shape, x_cl, r_cl, dtype, atol, rtol, device, poison_empty):
    x, r, b, rb = _inputs(shape, dtype, device, x_cl, r_cl)
    y = bias_residual_add(x, r, b)
    _check(y, x, _fp32_reference(x, r, b), atol, rtol)
    y = bias_residual_add(x, r, b, rb)
    _check(y, x, _fp32_reference(x, r, b, rb), atol, rtol)


@pytest.mark.parametrize("x_cl, r_cl", [pytest.param(True, False, id="x-cl-residual-nchw"),
                                        pytest.param(False, True, id="x-nchw-residual-cl")])
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_residual_in_the_other_memory_format(x_cl, r_cl, dtype, atol, rtol, device, poison_empty):
    """The output keeps x's format (the conv output's) whatever the residual's is."""
    x, r, b, rb = _inputs((2, 320, 6, 5), dtype, device, x_cl, r_cl, seed=1)
    y = bias_residual_add(x, r, b, rb)
    _check(y, x, _fp32_reference(x, r, b, rb), atol, rtol)
    assert y.is_contiguous(memory_format=CL if x_cl else torch.contiguous_format)


@pytest.mark.parametrize("x_cl", [False, True], ids=["nchw", "cl"])
def test_in_place_into_x(x_cl, device):
    x, r, b, rb = _inputs((2, 320, 4, 6), torch.float16, device, x_cl, x_cl, seed=2)
    ref = _fp32_reference(x, r, b, rb)
    y = bias_residual_add(x, r, b, rb, out=x)
    assert y is x
    _check(y, x, ref, 2e-3, 2e-3)


@pytest.mark.parametrize("case", ["no-biases", "fp32-biases-fp16-x", "residual-bias-only", "residual-is-x"])
def test_bias_variants(case, device, poison_empty):
    dtype = torch.float16
    x, r, b, rb = _inputs((2, 640, 3, 5), dtype, device, True, True, b_dtype=torch.float32
                          if case == "fp32-biases-fp16-x" else None, seed=3)
    if case == "no-biases":
        b = rb = None
    elif case == "residual-bias-only":
        b = None
    elif case == "residual-is-x":
        r = x
    y = bias_residual_add(x, r, b, rb)
    _check(y, x, _fp32_reference(x, r, b, rb), 2e-3, 2e-3)


def test_equals_the_host_order_within_one_rounding(device):
    """The host rounds after the bias add and again after the residual add; the kernel rounds once, so
    it is at least as close to the exact sum (fp16)."""
    x, r, b, rb = _inputs((2, 320, 8, 8), torch.float16, device, True, True, seed=4)
    exact = _fp32_reference(x, r, b, rb)
    ours = bias_residual_add(x, r, b, rb).float()
    host = bias_residual_add_reference(x, r, b, rb).float()
    assert (ours - exact).abs().max() <= (host - exact).abs().max() + 1e-6


# ---- fallbacks: never mistaken for the kernel, same result as the reference, x's format kept ----

def _assert_fallback(x, r, b=None, rb=None, reason=None, out=None):
    ok, why = eligible(x, r, b, rb, out)
    assert not ok and why and (reason is None or reason in why), why
    ref = bias_residual_add_reference(x, r, b, rb)
    y = bias_residual_add(x, r, b, rb, out=out)
    assert bias_residual_add.last_call.path == "reference" and bias_residual_add.last_call.reason == why
    torch.testing.assert_close(y, ref.to(y.dtype))
    return y


def test_fallback_fp64(device):
    x, r, b, _ = _inputs((1, 64, 3, 3), torch.float64, device)
    _assert_fallback(x, r, b, reason="dtype")


def test_fallback_broadcast_residual(device):
    x, r, b, _ = _inputs((2, 64, 3, 3), torch.float32, device)
    _assert_fallback(x, r[:1], b, reason="shape")


def test_fallback_residual_of_another_dtype(device):
    x, r, b, _ = _inputs((2, 64, 3, 3), torch.float16, device)
    _assert_fallback(x, r.float(), b, reason="dtype or device")


def test_fallback_cropped_residual(device):
    x, r, b, _ = _inputs((1, 64, 4, 4), torch.float32, device)
    big = torch.randn(1, 64, 6, 6, device=device)
    _assert_fallback(x, big[:, :, 1:5, 1:5], b, reason="layout")


def test_fallback_strided_x_keeps_working(device):
    x, r, b, _ = _inputs((1, 64, 8, 4), torch.float32, device)
    _assert_fallback(x[:, :, ::2], r[:, :, ::2], b, reason="contiguous")


def test_fallback_overlapping_out(device):
    x, _, b, _ = _inputs((1, 64, 4, 4), torch.float32, device)
    buf = torch.randn(2 * x.numel(), device=device)
    out = buf[:x.numel()].view(x.shape)
    r = buf[16:16 + x.numel()].view(x.shape)     # shares out's memory, shifted: a race in place
    _assert_fallback(x, r, b, reason="overlaps", out=out)


def test_fallback_keeps_channels_last_and_out(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, r, b, rb = _inputs((1, 64, 3, 3), torch.float16, "cpu", True, False)
    y = _assert_fallback(x, r, b, rb, reason="CPU tensor")
    assert y.is_contiguous(memory_format=CL)
    ref = bias_residual_add_reference(x, r, b, rb)
    y = bias_residual_add(x, r, b, rb, out=x)
    assert y is x and torch.equal(x, ref)


def test_fallback_no_triton(monkeypatch, device):
    monkeypatch.setattr(_triton, "get_triton", lambda: None)
    x, r, b, _ = _inputs((1, 64, 3, 3), torch.float32, device)
    _assert_fallback(x, r, b, reason="no Triton")


def test_fallback_autograd(device):
    x, r, b, _ = _inputs((1, 64, 3, 3), torch.float32, device)
    x.requires_grad_(True)
    y = _assert_fallback(x, r, b, reason="autograd")
    assert y.requires_grad


def test_fallback_bias_wrong_size(device):
    x, r, _, _ = _inputs((1, 64, 3, 3), torch.float32, device)
    ok, why = eligible(x, r, torch.ones(32, device=device))
    assert not ok and "bias" in why
    with pytest.raises(RuntimeError):
        bias_residual_add(x, r, torch.ones(32, device=device))


def test_cuda_graph_capture():
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU")
    x, r, b, rb = _inputs((2, 320, 16, 16), torch.float16, "cuda", True, True)
    bias_residual_add(x, r, b, rb)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = bias_residual_add(x, r, b, rb)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(y.float(), _fp32_reference(x, r, b, rb), atol=2e-3, rtol=2e-3)
