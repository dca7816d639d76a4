"""geglu against `a * F.gelu(gate)` computed in fp32 from the same (upcast) input."""
import pytest
import torch

from sd_accel.kernels import _triton
from sd_accel.kernels.geglu import eligible, geglu, geglu_reference

# (batch, tokens, 2 * D): SD1.5 / SDXL widths with the token count scaled down, plus odd sizes
SHAPES = [
    pytest.param((2, 64, 2560), id="sd15-D1280"),
    pytest.param((2, 16, 5120), id="sd15-D2560"),
    pytest.param((1, 4, 10240), id="sd15-D5120"),
    pytest.param((3, 5, 20), id="odd-D10"),
    pytest.param((7, 2), id="D1"),
    pytest.param((1, 1, 2600), id="one-row-D1300"),
]
DTYPES = [
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.float16, 2e-3, 2e-3, id="fp16"),
    pytest.param(torch.bfloat16, 1e-2, 1e-2, id="bf16"),
]


def _input(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 2).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_geglu(shape, dtype, atol, rtol, device, poison_empty):
    h = _input(shape, dtype, device)
    out = geglu(h)
    assert geglu.last_call.path == "triton", geglu.last_call.reason
    assert out.dtype == dtype and out.shape == shape[:-1] + (shape[-1] // 2,) and out.is_contiguous()
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), geglu_reference(h.float()), atol=atol, rtol=rtol)


def test_geglu_is_exact_erf_gelu(device):
    # tanh-approximate GELU differs from erf GELU by up to ~5e-4 around |x| ~ 2; fp32 must match erf
    h = torch.linspace(-6, 6, 2 * 512, device=device).view(1, 2 * 512)
    h = torch.cat([torch.ones_like(h), h], dim=-1)
    out = geglu(h)
    assert geglu.last_call.path == "triton"
    torch.testing.assert_close(out, torch.nn.functional.gelu(h[:, 1024:]), atol=1e-6, rtol=1e-5)


def _assert_fallback(h, reason):
    ok, why = eligible(h)
    assert not ok and reason in why, why
    out = geglu(h)
    assert geglu.last_call.path == "reference" and geglu.last_call.reason == why
    torch.testing.assert_close(out, geglu_reference(h))
    assert out.is_contiguous()


def test_fallback_fp64(device):
    _assert_fallback(_input((2, 3, 8), torch.float64, device), "dtype")


def test_fallback_odd_last_dim_raises_like_reference(device):
    h = _input((2, 3, 9), torch.float32, device)
    assert eligible(h) == (False, "last dim not even")
    with pytest.raises(RuntimeError):
        geglu(h)
    assert geglu.last_call.path == "reference"


def test_fallback_non_contiguous(device):
    _assert_fallback(_input((2, 8, 6), torch.float32, device).transpose(1, 2), "non-contiguous")


def test_fallback_autograd(device):
    _assert_fallback(_input((2, 3, 8), torch.float32, device).requires_grad_(True), "autograd")


def test_fallback_cpu_tensor_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _assert_fallback(_input((2, 3, 8), torch.float16, "cpu"), "CPU tensor")


def test_fallback_no_triton(monkeypatch, device):
    monkeypatch.setattr(_triton, "get_triton", lambda: None)
    _assert_fallback(_input((2, 3, 8), torch.float32, device), "no Triton")


def test_integer_dtype_not_eligible(device):
    h = torch.ones(2, 8, dtype=torch.int32, device=device)
    assert eligible(h) == (False, "dtype torch.int32")
