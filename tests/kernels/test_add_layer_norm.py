"""add_layer_norm: the sum exactly as torch's add rounds it, the norm against F.layer_norm of that sum in fp32."""
import pytest
import torch

from sd_accel.kernels import _triton
from sd_accel.kernels.add_layer_norm import add_layer_norm, add_layer_norm_reference, eligible
from sd_accel.kernels.layer_norm import layer_norm_reference
from test_layer_norm import DTYPES, SHAPES   # the same labelled shapes and (dtype, atol, rtol) as layer_norm


def _inputs(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = shape[-1]
    a = torch.randn(shape, generator=g) * 3
    r = torch.randn(shape, generator=g) * 5 + torch.randn(shape[:-1] + (1,), generator=g) * 2
    w = torch.randn(D, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(D, generator=g).to(device=device, dtype=dtype)
    return a.to(device=device, dtype=dtype), r.to(device=device, dtype=dtype), w, b


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_sum_is_torchs_and_norm_matches(shape, dtype, atol, rtol, device, poison_empty):
    a, r, w, b = _inputs(shape, dtype, device)
    s, y = add_layer_norm(a, r, (shape[-1],), w, b, 1e-5)
    assert add_layer_norm.last_call.path == "triton", add_layer_norm.last_call.reason
    if dtype == torch.bfloat16 and _triton.interpret_mode():
        # Triton's CPU interpreter truncates fp32 -> bf16 (a GPU rounds to nearest even, as torch does):
        # within one bf16 step there
        step = (a + r).float().abs() * 2.0 ** -7
        assert ((s.float() - (a + r).float()).abs() <= step).all()
    else:
        assert torch.equal(s, a + r)                 # bit for bit: what `x = n + x` stores
    assert y.dtype == dtype and y.shape == a.shape and not torch.isnan(y).any()
    ref = layer_norm_reference(s.float(), (shape[-1],), w.float(), b.float(), 1e-5)
    torch.testing.assert_close(y.float(), ref, atol=atol, rtol=rtol)


def test_no_affine_and_fp32_weights_with_half_inputs(device, poison_empty):
    a, r, _, _ = _inputs((2, 8, 320), torch.float16, device, seed=1)
    s, y = add_layer_norm(a, r, 320)
    assert add_layer_norm.last_call.path == "triton"
    torch.testing.assert_close(y.float(), layer_norm_reference(s.float(), (320,)), atol=2e-3, rtol=2e-3)
    w = torch.randn(320, device=device)
    s, y = add_layer_norm(a, r, (320,), w, None)
    torch.testing.assert_close(y.float(), layer_norm_reference(s.float(), (320,), w), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("case", ["residual-shape", "residual-dtype", "residual-strided", "wide-normalized"])
def test_ineligible_inputs_fall_back_to_the_reference_with_a_reason(case, device):
    a, r, w, b = _inputs((2, 6, 32), torch.float32, device, seed=2)
    shape = (32,)
    if case == "residual-shape":
        r = r[:, :1].contiguous()
    elif case == "residual-dtype":
        r = r.double()
    elif case == "residual-strided":
        r = r.transpose(0, 1).contiguous().transpose(0, 1)
    else:
        shape = (6, 32)
        w = b = None
    ok, why = eligible(a, r, shape, w, b)
    assert not ok and why
    if case == "residual-shape":
        return    # a + r broadcasts: the reference is still defined, but nothing in a UNet calls it so
    s, y = add_layer_norm(a, r, shape, w, b)
    assert add_layer_norm.last_call.path == "reference" and add_layer_norm.last_call.reason == why
    ref_s, ref_y = add_layer_norm_reference(a, r, shape, w, b)
    assert torch.equal(s, ref_s) and torch.equal(y, ref_y)
