"""Inside `stock_path.stock_modules()` every SD Accel stand-in computes exactly what the module it replaced
computes (engine/patches/stock_path.py): the eager path of a step that runs without graphs, at stock's speed.
ComfyUI's real UNet (tiny preset, CPU), every patch the ComfyUI host plans, compared bit for bit."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import comfy_inproc  # noqa: E402

from sd_accel.engine.reports import kernel_report  # noqa: E402
from sd_accel.engine.patches import fused_modules as fm  # noqa: E402
from sd_accel.engine.patches import layout_modules, patching, stock_path  # noqa: E402


@pytest.fixture(scope="module")
def unet(tmp_path_factory):
    return comfy_inproc.tiny_model_patcher(tmp_path_factory.mktemp("ckpt")).model.diffusion_model.float()


def _forward(unet, x, t, ctx):
    with torch.no_grad():
        return unet(x, t, context=ctx, transformer_options={})


def test_every_stand_in_in_stock_mode_is_the_stock_module_bit_for_bit(unet):
    x, t, ctx = comfy_inproc.unet_inputs(unet)
    ref = _forward(unet, x, t, ctx)
    plan = dict(layout_modules.plan_layout_patches(unet))
    plan.update(patching.plan_patches(unet, patching.COMFY_OPS).patches)
    kinds = {fm.kind_of(m) for m in plan.values()}
    assert {"group_norm", "layer_norm", "geglu", "resblock", "transformer_block", "layout"} <= kinds
    backup = patching.apply_patches(unet, plan)
    try:
        k0 = kernel_report.snapshot()
        with stock_path.stock_modules():
            stock = _forward(unet, x, t, ctx)
        ran = kernel_report.summarize(k0, kernel_report.snapshot())
        fused = _forward(unet, x, t, ctx)
    finally:
        patching.restore(unet, backup)
    assert torch.equal(stock, ref)
    assert ran == {}, "no fused kernel runs on the stock path"
    assert not torch.equal(fused, ref) and torch.allclose(fused, ref, rtol=1e-3, atol=1e-3)   # the fused path
    assert torch.equal(_forward(unet, x, t, ctx), ref), "restored"


def test_under_torch_compile_every_stand_in_traces_as_the_stock_module(unet):
    """A TorchCompileModel placed after Apply SD Accel compiles a UNet that holds the stand-ins: dynamo must trace
    the host's own modules there (it failed the prompt tracing a fused kernel's launch), whatever scope it sees.
    No scope here: the test is the compile alone. Backend "eager": dynamo's trace, run as traced."""
    import torch._dynamo
    x, t, ctx = comfy_inproc.unet_inputs(unet)
    ref = _forward(unet, x, t, ctx)
    plan = dict(layout_modules.plan_layout_patches(unet))
    plan.update(patching.plan_patches(unet, patching.COMFY_OPS).patches)
    backup = patching.apply_patches(unet, plan)
    try:
        compiled = torch.compile(unet, backend="eager", fullgraph=False)
        k0 = kernel_report.snapshot()
        out = _forward(compiled, x, t, ctx)
        ran = kernel_report.summarize(k0, kernel_report.snapshot())
    finally:
        patching.restore(unet, backup)
        torch._dynamo.reset()
    assert ran == {}, ran
    assert torch.equal(out, ref)


def test_the_switch_is_per_thread():
    import threading
    seen = []
    with stock_path.stock_modules():
        th = threading.Thread(target=lambda: seen.append(stock_path.active()))
        th.start()
        th.join()
        seen.append(stock_path.active())
    assert seen == [False, True] and not stock_path.active()


def test_fused_modules_leaves_the_stock_scope_for_its_calls_only():
    """A call passed through to SD Accel's step from inside a stock scope (hosts/comfyui/unet_bypass.py) computes
    the stand-ins' own way; the scope holds again after it, also when the call raised."""
    with stock_path.stock_modules(), stock_path.stock_modules():
        with stock_path.fused_modules():
            assert not stock_path.active()
        assert stock_path.LOCAL.depth == 2
        with pytest.raises(RuntimeError):
            with stock_path.fused_modules():
                raise RuntimeError("inside")
        assert stock_path.LOCAL.depth == 2
    assert not stock_path.active()


def test_a_host_forward_another_pack_replaced_is_what_the_stand_in_runs():
    """AnimateDiff v1 swaps GroupNorm's forward (to normalise across frames) for the UNet's call: our fused
    GroupNorm must compute that, not its own kernel."""
    from sd_accel.engine.patches import fused_modules as fm
    gn = torch.nn.GroupNorm(2, 4)
    fused = fm.make_fused_group_norm(gn, "silu")
    x = torch.randn(2, 4, 3, 3)
    saved = torch.nn.GroupNorm.forward
    torch.nn.GroupNorm.forward = lambda self, inp: inp * 0 + 7.0
    try:
        assert fm.host_replaced(fused)
        assert torch.equal(fused(x), torch.nn.functional.silu(torch.full_like(x, 7.0)))
    finally:
        torch.nn.GroupNorm.forward = saved
    assert not fm.host_replaced(fused)
    assert torch.allclose(fused(x), torch.nn.functional.silu(gn(x)), atol=1e-5)
