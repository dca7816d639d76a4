"""The FP8 Linear stand-in and its GEMM recipes on the CPU (torch._scaled_mm runs there; the per-token
quantization in Triton's interpreter): against an fp32 reference, on random weights and on weights and
activations with heavy-tailed outlier channels; the FP8 copy of a weight follows every change of it."""
import os

import pytest
import torch
from torch import nn

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from sd_accel.engine.fp8 import gemm, weights  # noqa: E402
from sd_accel.engine.fp8.linear import Fp8Forward, make_fp8_linear  # noqa: E402
from sd_accel.engine.fp8.plan import plan_fp8  # noqa: E402
from sd_accel.engine.patches import stock_path  # noqa: E402
from sd_accel.kernels.quantize_rows import quantize_weight_per_channel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# e4m3 keeps 3 mantissa bits: each operand's rounding error is ~2**-4 / sqrt(3) rms, so a product of two
# quantized operands is off by ~3.5% rms; a wrong scale or layout is off by 100%
REL_TOL = 6e-2


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _linear(k, n, seed=0, outliers=False):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n).to(DEVICE, torch.float16)
    if outliers:
        with torch.no_grad():
            lin.weight[:3] *= torch.tensor([10.0, 40.0, 100.0], device=DEVICE, dtype=torch.float16)[:, None]
            lin.weight[:, :2] *= 30
    return lin.eval()


def _x(m, k, seed=1, outliers=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if outliers:
        x[:, 5] *= 60
        x[:, 9] *= 15
    return x.to(DEVICE, torch.float16)


@pytest.mark.parametrize("recipe", gemm.RECIPES)
@pytest.mark.parametrize("outliers", [False, True], ids=["random", "outlier-channels"])
def test_recipes_match_fp32_reference(recipe, outliers):
    lin, x = _linear(320, 640, outliers=outliers), _x(77, 320, outliers=outliers)
    wq, ws = quantize_weight_per_channel(lin.weight.detach())
    try:
        with torch.no_grad():
            out = gemm.fp8_linear(x, wq, ws, lin.bias, recipe)
    except RuntimeError as e:
        pytest.skip("this torch build's _scaled_mm refuses the %s recipe (%s); the probe skips it too" % (recipe, e))
    ref = torch.addmm(lin.bias.detach().float(), x.float(), lin.weight.detach().float().t())
    assert out.dtype == torch.float16 and out.shape == (77, 640)
    assert _rel(out, ref) < REL_TOL


def test_probe_picks_a_recipe_that_runs():
    recipe = gemm.probe(torch.device(DEVICE))
    assert recipe in gemm.RECIPES
    assert gemm.probe(torch.device(DEVICE)) == recipe


def test_a_probe_whose_triton_kernels_are_still_compiling_chooses_again_on_the_next_call(monkeypatch):
    """Inside a pass compiling kernels ahead, the "triton" recipe's ops run their references (its kernels have no
    binary yet), which says nothing of the kernels: that call takes another recipe, and the next call, the
    kernels compiled, probes again and keeps "triton" (a first fp8 step on a cold Triton cache had kept
    rowwise_fp16 for the process, with no GEGLU epilogue)."""
    from sd_accel.kernels import _compile_ahead, fp8_gemm as fp8_gemm_module
    device = torch.device(DEVICE)
    monkeypatch.setattr(gemm, "_chosen", {})
    real_launch = fp8_gemm_module.launch

    def still_compiling(kernel, grid, *args, **meta):
        raise _compile_ahead.CompilingAhead(getattr(kernel, "__name__", "fp8_gemm"))
    monkeypatch.setattr(fp8_gemm_module, "launch", still_compiling)
    first = gemm.probe(device)
    assert first != "triton" and not gemm.probed(device)
    monkeypatch.setattr(fp8_gemm_module, "launch", real_launch)
    assert gemm.probe(device) == "triton" and gemm.probed(device)


def test_a_first_fp8_call_before_any_probe_asks_no_cuda_question_of_a_cpu_tensor(monkeypatch):
    """The capture check before a first probe is for CUDA inputs only: on a machine whose torch has CUDA but no
    driver, asking torch.cuda about capture raises."""
    monkeypatch.setattr(gemm, "_chosen", {})

    def no_driver():
        raise RuntimeError("CUDA driver version is insufficient for CUDA runtime version")
    if DEVICE == "cpu":
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", no_driver)
    lin = _linear(320, 640)
    with torch.no_grad():
        out = make_fp8_linear(lin)(_x(16, 320))
    assert out.shape == (16, 640) and gemm.probed(torch.device(DEVICE))


def test_a_triton_recipe_that_fails_for_good_is_not_probed_again(monkeypatch):
    """A kernel that cannot run (not one still compiling) settles the choice on the next recipe."""
    from sd_accel.kernels import fp8_gemm as fp8_gemm_module
    device = torch.device(DEVICE)
    monkeypatch.setattr(gemm, "_chosen", {})
    monkeypatch.setattr(fp8_gemm_module.fp8_gemm, "eligible", lambda *a: (False, "no Triton here"))
    first = gemm.probe(device)
    assert first != "triton" and gemm.probed(device)


def test_the_forward_patch_set_on_the_host_linear_matches_fp16():
    """Set as the Linear's own forward (as ComfyUI sets an object patch at `<path>.forward`), the module stays the
    host's, with its own parameters, and calls run FP8; taken off, the host's forward runs again."""
    lin = _linear(320, 1280)
    x = _x(4 * 16, 320).reshape(4, 16, 320)
    with torch.no_grad():
        ref = lin(x)
        old = lin.forward
        lin.forward = make_fp8_linear(lin)
        out = lin(x)
        lin.forward = old
        assert torch.equal(lin(x), ref)
    assert type(lin) is nn.Linear and out.shape == ref.shape and out.dtype == torch.float16
    assert 0 < _rel(out, ref) < REL_TOL      # lossy, but close


def test_stock_scope_runs_the_host_forward():
    lin = _linear(64, 32)
    new = make_fp8_linear(lin)
    x = _x(8, 64)
    with torch.no_grad(), stock_path.stock_modules():
        assert torch.equal(new(x), lin(x))


def test_fp32_activations_run_the_host_forward():
    lin = nn.Linear(64, 32).to(DEVICE)
    new = make_fp8_linear(lin)
    x = torch.randn(8, 64, device=DEVICE)
    with torch.no_grad():
        assert torch.equal(new(x), lin(x))


def test_fp8_copy_follows_weight_changes():
    lin = _linear(64, 32)
    new = make_fp8_linear(lin)
    x = _x(8, 64)
    with torch.no_grad():
        first = new(x)
        assert torch.equal(new(x), first)
        lin.weight.mul_(2)                      # in place: the version counter moves
        ref = lin(x)
        assert _rel(new(x), ref) < REL_TOL and _rel(new(x), first) > 0.5
        lin.weight = nn.Parameter(lin.weight * -1, requires_grad=False)    # replaced: a new tensor
        assert _rel(new(x), lin(x)) < REL_TOL


def test_inference_weight_follows_host_state():
    with torch.inference_mode():
        lin = _linear(64, 32)
        new = make_fp8_linear(lin)
        x = _x(8, 64)
        with weights.host_state("a"):
            before = new(x)
        lin.weight.mul_(3)                      # an inference tensor: no version counter, only the host state
        with weights.host_state("b"):
            after = new(x)
        assert _rel(after, lin(x)) < REL_TOL and _rel(after, before) > 1.0


def test_copies_are_counted_and_die_with_their_weight():
    import gc
    gc.collect()
    lin = _linear(64, 48)
    new = make_fp8_linear(lin)
    base = weights.bytes_on()
    with torch.no_grad():
        new(_x(8, 64))
    assert weights.bytes_on() - base == 64 * 48 + 48 * 4
    del new, lin
    gc.collect()
    assert weights.bytes_on() == base


def test_fp8_stored_weight_used_as_stored():
    lin = _linear(64, 32)
    with torch.no_grad():
        lin.weight.data = lin.weight.data.to(torch.float8_e4m3fn)
    new = make_fp8_linear(lin)
    x = _x(8, 64)
    with torch.no_grad():
        ref = torch.addmm(lin.bias.float(), x.float(), lin.weight.float().t())
        out = new(x)
    assert _rel(out, ref) < REL_TOL


def test_plan_takes_the_feed_forward_geglu_projections_only():
    """The GEGLU projection of each transformer block; attention's projections, the feed-forward's output,
    proj_in/proj_out and Linears outside the transformers stay fp16."""
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.to_q, self.to_k, self.to_v = nn.Linear(32, 32), nn.Linear(48, 32), nn.Linear(48, 32)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn1, self.attn2 = Attention(), Attention()
            self.ff = nn.Module()
            self.ff.net = nn.Sequential(GEGLU(32, 128), nn.Dropout(0.0), nn.Linear(128, 32))

    class Transformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj_in, self.transformer_blocks = nn.Linear(16, 32), nn.ModuleList([Block()])
            self.proj_out = nn.Linear(32, 16)

    root = nn.Module()
    root.time_embed = nn.Sequential(nn.Linear(32, 64))
    root.st = Transformer()
    plan = plan_fp8(root, "diffusion_model.")
    assert sorted(plan) == ["diffusion_model.st.transformer_blocks.0.ff.net.0.proj.forward"]
    assert all(isinstance(p, Fp8Forward) for p in plan.values())
    assert plan["diffusion_model.st.transformer_blocks.0.ff.net.0.proj.forward"].module is \
        root.st.transformer_blocks[0].ff.net[0].proj


class GEGLU(nn.Module):
    """ComfyUI's GEGLU (comfy/ldm/modules/attention.py): a projection to twice the width, then chunk, GELU, product."""

    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2)

    def forward(self, x):
        x, gate = self.proj(x).chunk(2, dim=-1)
        return x * torch.nn.functional.gelu(gate)


def test_geglu_runs_in_the_fp8_gemm_epilogue():
    """A fused GEGLU whose projection computes in FP8 asks that projection for the GEGLU itself: one GEMM with the
    GEGLU in its epilogue, the same values as GEGLU of the FP8 projection's output; in the stock scope both are the
    host's."""
    from sd_accel.engine.patches import fused_modules as fm
    from sd_accel.engine.reports import kernel_report
    torch.manual_seed(5)
    host = GEGLU(64, 96).to(DEVICE, torch.float16).eval()
    fused = fm.make_fused_geglu(host)
    fp8_proj = make_fp8_linear(host.proj)
    x = _x(2 * 24, 64).reshape(2, 24, 64)
    with torch.no_grad():
        ref = host(x)
        host.proj.forward = fp8_proj              # the object patch at ff.net.0.proj.forward
        before = kernel_report.snapshot()
        out = fused(x)
        calls = kernel_report.summarize(before, kernel_report.snapshot())
        a, gate = fp8_proj(x).float().chunk(2, dim=-1)
        with stock_path.stock_modules():
            stock = fused(x)
        del host.proj.forward
    assert out.shape == (2, 24, 96) and out.dtype == torch.float16
    torch.testing.assert_close(out.float(), a * torch.nn.functional.gelu(gate), rtol=2e-3, atol=2e-3)
    assert 0 < _rel(out, ref) < REL_TOL
    assert torch.equal(stock, ref)
    assert calls.get("fp8_linear", {}).get("fused") == 1 and "geglu" not in calls, calls
