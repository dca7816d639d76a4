"""layer_norm against F.layer_norm computed in fp32 from the same (upcast) inputs."""
import pytest
import torch

from sd_accel.kernels import _triton
from sd_accel.kernels.layer_norm import eligible, layer_norm, layer_norm_reference

# (batch, tokens, D): SD1.5 / SDXL transformer widths with the token count scaled down, plus odd sizes
SHAPES = [
    pytest.param((2, 64, 320), id="sd15-320"),
    pytest.param((2, 16, 640), id="sd15-640"),
    pytest.param((1, 8, 1280), id="sd15-1280"),
    pytest.param((3, 5, 33), id="odd-D33"),
    pytest.param((1, 1, 1280), id="one-row"),
    pytest.param((9, 1), id="D1"),
]
DTYPES = [
    pytest.param(torch.float32, 2e-5, 2e-5, id="fp32"),
    pytest.param(torch.float16, 2e-3, 2e-3, id="fp16"),
    pytest.param(torch.bfloat16, 1e-2, 1e-2, id="bf16"),
]


def _inputs(shape, dtype, device, w_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = shape[-1]
    x = (torch.randn(shape, generator=g) * 3 + torch.randn(shape[:-1] + (1,), generator=g) * 2)
    w = torch.randn(D, generator=g).to(device=device, dtype=w_dtype or dtype)
    b = torch.randn(D, generator=g).to(device=device, dtype=w_dtype or dtype)
    return x.to(device=device, dtype=dtype), w, b


def _fp32_reference(x, w, b, eps=1e-5):
    up = lambda t: None if t is None else t.float()
    return layer_norm_reference(x.float(), (x.shape[-1],), up(w), up(b), eps)


def _check(y, x, ref, atol, rtol):
    assert layer_norm.last_call.path == "triton", layer_norm.last_call.reason
    assert y.dtype == x.dtype and y.shape == x.shape and y.is_contiguous()
    assert not torch.isnan(y).any()
    torch.testing.assert_close(y.float(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm(shape, dtype, atol, rtol, device, poison_empty):
    x, w, b = _inputs(shape, dtype, device)
    y = layer_norm(x, (shape[-1],), w, b, 1e-5)
    _check(y, x, _fp32_reference(x, w, b), atol, rtol)


@pytest.mark.parametrize(
    "x_dtype, w_dtype, affine",
    [
        pytest.param(torch.float16, torch.float32, "wb", id="fp32-weight-fp16-x"),
        pytest.param(torch.bfloat16, torch.float32, "wb", id="fp32-weight-bf16-x"),
        pytest.param(torch.float16, None, "", id="no-affine"),
        pytest.param(torch.float32, None, "w", id="weight-only"),
        pytest.param(torch.float32, None, "b", id="bias-only"),
    ],
)
def test_affine_variants(x_dtype, w_dtype, affine, device, poison_empty):
    x, w, b = _inputs((2, 24, 320), x_dtype, device, w_dtype, seed=1)
    w = w if "w" in affine else None
    b = b if "b" in affine else None
    y = layer_norm(x, 320, w, b, 1e-6)  # normalized_shape as a plain int works too
    tol = 2e-5 if x_dtype == torch.float32 else 1e-2
    _check(y, x, _fp32_reference(x, w, b, 1e-6), tol, tol)


def _assert_fallback(x, normalized_shape, w, b, reason):
    ok, why = eligible(x, normalized_shape, w, b)
    assert not ok and reason in why, why
    y = layer_norm(x, normalized_shape, w, b)
    assert layer_norm.last_call.path == "reference" and layer_norm.last_call.reason == why
    torch.testing.assert_close(y, layer_norm_reference(x, normalized_shape, w, b))


def test_fallback_fp64(device):
    x, w, b = _inputs((2, 3, 16), torch.float64, device)
    _assert_fallback(x, (16,), w, b, "dtype")


def test_fallback_two_normalized_dims(device):
    x, _, _ = _inputs((2, 3, 16), torch.float32, device)
    _assert_fallback(x, (3, 16), None, None, "normalized_shape")


def test_non_contiguous_input_runs_the_kernel(device):
    x, w, b = _inputs((2, 3, 16), torch.float32, device)
    x = x.transpose(1, 2).contiguous().transpose(1, 2)  # same shape, last dim strided
    y = layer_norm(x, (16,), w, b)
    assert layer_norm.last_call.path == "triton", layer_norm.last_call.reason
    torch.testing.assert_close(y, layer_norm_reference(x, (16,), w, b), atol=1e-5, rtol=1e-5)
    ok, why = eligible(x, (16,), w, b)     # the kernel itself still needs rows in one block
    assert not ok and "non-contiguous" in why


def test_fallback_autograd(device):
    x, w, b = _inputs((2, 3, 16), torch.float32, device)
    _assert_fallback(x, (16,), w.requires_grad_(True), b, "autograd")


def test_fallback_cpu_tensor_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w, b = _inputs((2, 3, 16), torch.float32, "cpu")
    _assert_fallback(x, (16,), w, b, "CPU tensor")


def test_fallback_no_triton(monkeypatch, device):
    monkeypatch.setattr(_triton, "get_triton", lambda: None)
    x, w, b = _inputs((2, 3, 16), torch.float32, device)
    _assert_fallback(x, (16,), w, b, "no Triton")


def test_integer_dtype_not_eligible(device):
    x = torch.ones(2, 8, dtype=torch.int32, device=device)
    assert eligible(x, (8,)) == (False, "dtype torch.int32")
