"""fp8_gemm against its fp32 reference from the dequantized operands: plain (scales and bias in the epilogue) and
GEGLU (value * gelu(gate) of the product's two halves), over SD's transformer widths with the token count scaled
down, K tails that BLOCK_K does not divide, and edge tiles in M and N."""
import pytest
import torch
import torch.nn.functional as F

from sd_accel.kernels.fp8_gemm import Config, config_for, eligible, fp8_gemm, fp8_gemm_reference
from sd_accel.kernels.quantize_rows import quantize_rows_reference, quantize_weight_per_channel

# (tokens M, in features K, out features N)
SHAPES = [
    pytest.param((64, 320, 320), id="sd15-attn-320"),
    pytest.param((40, 1280, 1280), id="sdxl-attn-1280-edge-m"),
    pytest.param((16, 640, 2560), id="ff-in-640"),
    pytest.param((24, 2560, 640), id="ff-out-2560"),
    pytest.param((33, 768, 336), id="odd-m-and-n-edge"),
    pytest.param((8, 80, 48), id="k-tail-80"),
]


def _operands(M, K, N, device, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    x[:, 3] *= 30                       # an outlier channel, as SD activations have
    w = torch.randn(N, K, generator=g) / K ** 0.5
    b = torch.randn(N, generator=g).half() if bias else None
    xq, xs = quantize_rows_reference(x)
    wq, ws = quantize_weight_per_channel(w)
    return [t.to(device) if t is not None else None for t in (xq, xs, wq, ws, b)]


def _assert_close(out, ref):
    assert out.dtype == torch.float16 and out.shape == ref.shape and out.is_contiguous()
    assert not torch.isnan(out).any()
    # the same fp32 sums in another order: one fp16 rounding step apart at most, in a rare element two
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_gemm_matches_reference(shape, bias, device, poison_empty):
    M, K, N = shape
    xq, xs, wq, ws, b = _operands(M, K, N, device, bias=bias)
    out = fp8_gemm(xq, xs, wq, ws, b)
    assert fp8_gemm.last_call.path == "triton", fp8_gemm.last_call.reason
    _assert_close(out, fp8_gemm_reference(xq, xs, wq, ws, b))


@pytest.mark.parametrize("shape", [pytest.param((48, 320, 2560), id="sd15-ff-320"),
                                   pytest.param((20, 640, 160), id="edge-n"),
                                   pytest.param((9, 80, 64), id="k-tail")])
def test_fp8_gemm_geglu_matches_reference(shape, device, poison_empty):
    M, K, N = shape
    xq, xs, wq, ws, b = _operands(M, K, N, device, seed=1)
    out = fp8_gemm(xq, xs, wq, ws, b, geglu=True)
    assert fp8_gemm.last_call.path == "triton", fp8_gemm.last_call.reason
    assert out.shape == (M, N // 2)
    _assert_close(out, fp8_gemm_reference(xq, xs, wq, ws, b, geglu=True))
    # and the reference is GEGLU of the plain product: value columns first, then the gate's
    full = fp8_gemm_reference(xq, xs, wq, ws, b).float()
    value, gate = full.chunk(2, dim=-1)
    torch.testing.assert_close(out.float(), value * F.gelu(gate), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("config", [Config(16, 32, 32, 4, 2), Config(32, 16, 64, 4, 1)], ids=str)
def test_any_config_gives_the_same_result(config, device):
    # the benchmark's sweep launches other tile shapes: each must compute the same GEMM
    xq, xs, wq, ws, b = _operands(40, 192, 96, device, seed=2)
    out = fp8_gemm(xq, xs, wq, ws, b, config=config)
    assert fp8_gemm.last_call.path == "triton"
    _assert_close(out, fp8_gemm_reference(xq, xs, wq, ws, b))


def test_dequantized_product_is_close_to_the_fp32_linear():
    # what the op is for: within e4m3's error of x @ w.T + b (per-token and per-channel scales)
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(64, 320, generator=g), torch.randn(640, 320, generator=g) / 18
    b = torch.randn(640, generator=g).half()
    xq, xs = quantize_rows_reference(x)
    wq, ws = quantize_weight_per_channel(w)
    ref = x @ w.t() + b.float()
    got = fp8_gemm_reference(xq, xs, wq, ws, b).float()
    assert float((got - ref).norm() / ref.norm()) < 5e-2


def test_refusals_say_why(device):
    xq, xs, wq, ws, b = _operands(16, 64, 32, device)
    assert eligible(xq, xs, wq, ws, b, False) == (True, "")
    assert "multiply" in eligible(xq, xs, wq[:, :32].contiguous(), ws, b, False)[1]
    assert "fp16" in eligible(xq, xs, wq, ws, b.float(), False)[1]
    assert "scales" in eligible(xq, xs.double(), wq, ws, b, False)[1]
    odd = _operands(16, 64, 48, device)
    assert "multiples" in eligible(*odd, True)[1]      # GEGLU needs N / 2 a multiple of 16
    out = fp8_gemm(xq, xs, wq, ws, b.float())
    assert fp8_gemm.last_call.path == "reference" and "fp16" in fp8_gemm.last_call.reason
    assert out.dtype == torch.float16 and out.shape == (16, 32)


def test_configs_cover_sd_shapes():
    # BLOCK_K divides every K of SD1.5 and SDXL's transformer Linears, so their loads are never masked
    for K in (320, 640, 768, 1280, 2048, 2560, 5120):
        for M in (512, 2048, 8192):
            for geglu in (False, True):
                bm, bn, bk, warps, stages = config_for(M, 1280, K, geglu)
                assert K % bk == 0 and warps in (4, 8) and stages >= 2
