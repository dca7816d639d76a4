"""precision "fp8" on A1111's UNet (hosts/a1111_fp8.py) with the real ldm modules: refused with its reason on a CPU
(the UNet then runs exactly as with fp16); where it runs, the FP8 forwards on the feed-forward projections only,
near fp16, taken off again exactly; A1111's Lora extension (lora_standin.py) applied before quantizing, never stale
across LoRA changes, and its functional mode left to the host's forward.

The FP8 math runs on this CPU (torch._scaled_mm does; the per-token quantization in Triton's interpreter): where no
GPU is, `fp8_on_cpu` lifts the GPU-generation check only, which the first test covers as it is. The tests that compute in FP8 run the fused kernels
in the interpreter too (not `stock_kernels`): the FP8 GEMM's recipe is probed once per device, and the Triton one
is only chosen where Triton runs."""
import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from sd_accel.engine.fp8 import weights  # noqa: E402
from sd_accel.engine.reports import kernel_report  # noqa: E402
from sd_accel.hosts import a1111, a1111_fp8  # noqa: E402

import lora_standin  # noqa: E402
from unet_util import make_unet, unet_inputs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = a1111.A1111Options(precision="fp8")
BLOCK = "input_blocks.1.1"        # a SpatialTransformer of the test UNet: one transformer block, GEGLU feed-forward
PROJ = BLOCK + ".transformer_blocks.0.ff.net.0.proj"
# one transformer block with its GEGLU projection in FP8: e4m3's ~3.5% on that GEMM, diluted by the residuals
BLOCK_TOL = 3e-2


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setattr(a1111_fp8.support, "refusal", lambda device: None)
    # fp16 attention scores (ldm's ATTN_PRECISION=fp16): ldm's fp32 scores need autocast to meet fp16 values
    import ldm.modules.attention
    monkeypatch.setattr(ldm.modules.attention, "_ATTN_PRECISION", "fp16")


def _half_unet(seed=0):
    return make_unet(seed).to(DEVICE, torch.float16)


def _block_input(unet, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 32, 4, 4, generator=g).to(DEVICE, torch.float16)
    ctx = torch.randn(2, 5, 32, generator=g).to(DEVICE, torch.float16)
    return x, ctx


def _block(unet, x, ctx):
    with torch.no_grad():
        return a1111.patching.get_attr(unet, BLOCK)(x, context=ctx).float()


def _fp8_calls(fn):
    before = kernel_report.snapshot()
    out = fn()
    return out, kernel_report.summarize(before, kernel_report.snapshot()).get("fp8_linear", {})


def test_refused_on_cpu_with_its_reason_and_fp16_exactly(stock_kernels):
    """A UNet on the CPU (here on any machine): the real device check refuses, and it runs as with fp16."""
    unet, inputs = make_unet(), unet_inputs()
    s = a1111.apply(unet, FP8)
    assert s["precision"] == "fp16" and "fp8_linear" not in s["counts"]
    assert "sm_89/sm_90" in s["reasons"]["precision fp8"] and "cpu" in s["reasons"]["precision fp8"]
    with torch.no_grad():
        out = unet(*inputs)
    other = make_unet()
    a1111.apply(other, a1111.A1111Options())
    with torch.no_grad():
        assert torch.equal(out, other(*inputs))
    assert a1111.apply(unet, a1111.A1111Options())["reasons"] == {}


def test_lowvram_is_refused(fp8_on_cpu, stock_kernels):
    s = a1111.apply(_half_unet(), FP8, lowvram=True)
    assert s["precision"] == "fp16" and s["reasons"]["precision fp8"] == a1111_fp8.LOWVRAM


def test_fp8_on_the_projections_near_fp16_and_taken_off_exactly(fp8_on_cpu):
    unet = _half_unet()
    x, ctx = _block_input(unet)
    a1111.apply(unet, a1111.A1111Options())
    ref = _block(unet, x, ctx)
    s = a1111.apply(unet, FP8)
    assert s["precision"] == "fp8" and s["counts"]["fp8_linear"] == 4 and s["reasons"] == {}
    assert sorted(p for p, _ in unet.named_modules() if "forward" in dict(unet.named_modules())[p].__dict__
                  and p.endswith("ff.net.0.proj")) == sorted(n for n, _ in unet.named_modules()
                                                           if n.endswith("ff.net.0.proj"))
    out, calls = _fp8_calls(lambda: _block(unet, x, ctx))
    assert calls.get("fused") == 1 and not calls.get("fallback"), calls   # the block's one projection, in FP8
    assert 0 < _rel(out, ref) < BLOCK_TOL, _rel(out, ref)
    proj = a1111.patching.get_attr(unet, PROJ)
    # made at the first call (one FP8 weight and its scales), counted in the status
    assert a1111.status(unet)["derived_weight_copies_mib"] * 2 ** 20 >= proj.weight.numel() == weights.fp8_of(proj.weight)[0].numel()
    s = a1111.apply(unet, a1111.A1111Options())
    assert s["precision"] == "fp16" and "forward" not in proj.__dict__
    assert torch.equal(_block(unet, x, ctx), ref)
    a1111.apply(unet, FP8)
    assert a1111.remove(unet) == 42 and "forward" not in proj.__dict__


def test_fp32_activations_under_autocast_are_cast_as_f_linear_does(fp8_on_cpu):
    unet = _half_unet()
    a1111.apply(unet, FP8)
    proj = a1111.patching.get_attr(unet, PROJ)
    x = torch.randn(10, proj.in_features, device=DEVICE)
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.float16):
        out, calls = _fp8_calls(lambda: proj(x))
        ref = torch.nn.functional.linear(x, proj.weight, proj.bias)
    assert calls.get("fused") == 1 and out.dtype == torch.float16
    assert _rel(out, ref) < 6e-2


def _lora(unet, scale, seed):
    g = torch.Generator().manual_seed(seed)
    w = a1111.patching.get_attr(unet, PROJ).weight
    return lora_standin.Network("lora%d" % seed, {PROJ: (scale * torch.randn(w.shape, generator=g)).to(w.device)})


def test_lora_is_applied_before_quantizing_and_never_stale(fp8_on_cpu, monkeypatch):
    unet = _half_unet()
    nets = lora_standin.install(unet, monkeypatch)
    x, ctx = _block_input(unet)
    a1111.apply(unet, a1111.A1111Options())
    base16 = _block(unet, x, ctx)
    nets.loaded_networks[:] = [_lora(unet, 0.2, seed=5)]
    lora16 = _block(unet, x, ctx)
    assert _rel(lora16, base16) > 10 * BLOCK_TOL      # the LoRA moves the block far more than FP8 does
    a1111.apply(unet, FP8)
    lora8, calls = _fp8_calls(lambda: _block(unet, x, ctx))
    assert calls.get("fused") == 1 and _rel(lora8, lora16) < BLOCK_TOL
    nets.loaded_networks[:] = []                      # LoRA taken off: A1111 restores the weight at the next call
    base8 = _block(unet, x, ctx)
    assert _rel(base8, base16) < BLOCK_TOL and _rel(base8, lora16) > 10 * BLOCK_TOL
    nets.loaded_networks[:] = [_lora(unet, 0.2, seed=6)]   # another LoRA
    other8 = _block(unet, x, ctx)
    a1111.apply(unet, a1111.A1111Options())
    other16 = _block(unet, x, ctx)
    assert _rel(other8, other16) < BLOCK_TOL and _rel(other8, lora8) > 10 * BLOCK_TOL


def test_functional_lora_runs_the_hosts_forward(fp8_on_cpu, monkeypatch):
    unet = _half_unet()
    nets = lora_standin.install(unet, monkeypatch)
    x, ctx = _block_input(unet)
    a1111.apply(unet, FP8)
    nets.opts.lora_functional = True
    fp8_alone, calls = _fp8_calls(lambda: _block(unet, x, ctx))
    assert calls.get("fused") == 1                    # no network loaded: FP8 runs
    nets.loaded_networks[:] = [_lora(unet, 0.2, seed=5)]
    out, calls = _fp8_calls(lambda: _block(unet, x, ctx))
    assert calls.get("fallback") and not calls.get("fused") and a1111_fp8.FUNCTIONAL_LORA in calls["reasons"], calls
    a1111.apply(unet, a1111.A1111Options())
    assert torch.equal(out, _block(unet, x, ctx))     # exactly the host's fp16 forward with the LoRA added
