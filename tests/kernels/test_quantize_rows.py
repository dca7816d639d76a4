"""quantize_rows against the fp32 reference: the same scales, the same fp8 codes (or one e4m3 step apart where
fp32 rounding of x / scale lands on a tie), and x recovered within e4m3's relative precision."""
import pytest
import torch

from sd_accel.kernels import _triton
from sd_accel.kernels.quantize_rows import (E4M3_MAX, eligible, quantize_rows, quantize_rows_reference,
                                        quantize_weight_per_channel)

# (tokens, features): SD1.5 / SDXL transformer widths with the token count scaled down, plus odd sizes
SHAPES = [
    pytest.param((64, 320), id="sd15-320"),
    pytest.param((16, 1280), id="sdxl-1280"),
    pytest.param((4, 5120), id="ff-5120"),
    pytest.param((3, 10240), id="geglu-10240-two-chunks"),
    pytest.param((5, 17), id="odd-17"),
    pytest.param((1, 1), id="one"),
]
DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float32, id="fp32")]


def _input(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    x[:, :1] *= 40          # an outlier column, as activations have
    return x.to(device=device, dtype=dtype)


def _assert_matches_reference(x, q, scale):
    rq, rscale = quantize_rows_reference(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (x.shape[0], 1)
    torch.testing.assert_close(scale, rscale, rtol=1e-6, atol=0)
    # codes equal, or adjacent (x * (1/scale) and x / scale may round a tie differently)
    diff = (q.float() - rq.float()).abs()
    step = rq.float().abs().clamp_min(2 ** -6) * 2 ** -3
    assert bool((diff <= step + 1e-12).all()), float((diff - step).max())
    assert float(q.float().abs().max()) <= E4M3_MAX


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_rows(shape, dtype, device, poison_empty):
    x = _input(shape, dtype, device)
    q, scale = quantize_rows(x)
    assert quantize_rows.last_call.path == "triton", quantize_rows.last_call.reason
    _assert_matches_reference(x, q, scale)
    # every row's largest element reaches the format's largest value, and x comes back within e4m3's step
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((shape[0],), E4M3_MAX, device=device))
    back = q.float() * scale
    assert bool(((back - x.float()).abs() <= x.float().abs() * 2 ** -4 + scale * 2 ** -9 + 1e-30).all())


def test_zero_rows_quantize_to_zero(device):
    x = torch.zeros(3, 64, device=device, dtype=torch.float16)
    x[1] = 2.0
    q, scale = quantize_rows(x)
    assert quantize_rows.last_call.path == "triton"
    assert not torch.isnan(q.float()).any() and bool((q[0].float() == 0).all()) and bool((q[2].float() == 0).all())
    assert float(scale[0]) > 0 and float(scale[1]) == pytest.approx(2.0 / E4M3_MAX)


def test_strided_rows(device):
    # a view of every other column block: rows far apart, unit stride along K
    base = _input((6, 256), torch.float16, device)
    x = base[:, :128]
    q, scale = quantize_rows(x)
    assert quantize_rows.last_call.path == "triton"
    _assert_matches_reference(x, q, scale)


def test_weight_per_channel_scales():
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    w[3] *= 100      # an outlier output channel keeps its own scale; the others are not flattened by it
    q, scale = quantize_weight_per_channel(w)
    assert scale.shape == (1, 8) and q.shape == (8, 32)
    torch.testing.assert_close(scale.reshape(-1), w.abs().amax(dim=1) / E4M3_MAX, rtol=1e-6, atol=0)
    # each element within e4m3's half step (2^-4 relative for normals, scale * 2^-10 for subnormals) of w
    back = q.float() * scale.reshape(-1, 1)
    bound = w.abs() * 2 ** -4 + scale.reshape(-1, 1) * 2 ** -10
    assert bool(((back - w).abs() <= bound).all()), float(((back - w).abs() - bound).max())


def _assert_fallback(x, reason):
    ok, why = eligible(x)
    assert not ok and reason in why, why
    q, scale = quantize_rows(x)
    assert quantize_rows.last_call.path == "reference" and quantize_rows.last_call.reason == why
    rq, rscale = quantize_rows_reference(x)
    assert torch.equal(q.float(), rq.float()) and torch.equal(scale, rscale)


def test_fallback_fp64(device):
    _assert_fallback(torch.randn(4, 16, dtype=torch.float64, device=device), "dtype")


def test_fallback_transposed(device):
    _assert_fallback(torch.randn(16, 4, device=device).t(), "unit-stride")


def test_fallback_3d(device):
    _assert_fallback(torch.randn(2, 4, 16, device=device), "2-D")


def test_fallback_no_triton(monkeypatch, device):
    monkeypatch.setattr(_triton, "get_triton", lambda: None)
    _assert_fallback(torch.randn(4, 16, device=device), "no Triton")
