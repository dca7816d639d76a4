"""Attention backends: SDPA over ldm's layout equals plain attention math; backends that cannot run a
call fall back to SDPA with a reason; the ComfyUI host installs them as attention-replace patches that
give the stock UNet output."""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest
import torch

from sd_accel.engine.patches import attention
from sd_accel.engine.reports import kernel_report


def _reference(q, k, v, heads):
    b, n, inner = q.shape
    d = inner // heads
    q, k, v = (t.view(b, -1, heads, d).transpose(1, 2).double() for t in (q, k, v))
    w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)
    return (w @ v).transpose(1, 2).reshape(b, n, inner).float()


@pytest.mark.parametrize("shape,heads", [((2, 64, 320), 8), ((1, 16, 640), 8), ((2, 9, 1280), 20)])
def test_sdpa_matches_attention_math(shape, heads):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g) for _ in range(3))
    k2 = torch.randn(shape[0], 7, shape[2], generator=g)       # cross-attention: other token count
    v2 = torch.randn(shape[0], 7, shape[2], generator=g)
    assert torch.allclose(attention.sdpa(q, k, v, heads), _reference(q, k, v, heads), atol=1e-5)
    assert torch.allclose(attention.sdpa(q, k2, v2, heads), _reference(q, k2, v2, heads), atol=1e-5)


@pytest.mark.parametrize("backend", ["xformers", "sage"])
def test_backends_that_cannot_run_fall_back_to_sdpa_and_say_why(backend):
    fn = attention.attention_fn(backend)
    q = torch.randn(1, 8, 64)
    before = kernel_report.snapshot()
    out = fn(q, q, q, 2)
    assert torch.allclose(out, attention.sdpa(q, q, q, 2))
    rep = kernel_report.summarize(before, kernel_report.snapshot())["attention_" + backend]
    assert rep["fallback"] == 1 and rep["fused"] == 0
    assert "CUDA" in rep["reasons"][0]


def test_sage_refuses_sd15_head_dims(monkeypatch):
    monkeypatch.setitem(attention._modules, "sageattention", object())
    q = torch.zeros(1, 4, 320)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    ok, why = attention.eligible("sage", q.half(), heads=8)          # 320 / 8 = 40
    assert not ok and "head dim 40" in why
    ok, _ = attention.eligible("sage", torch.zeros(1, 4, 640).half(), heads=10)   # 64: SDXL's
    assert ok


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError):
        attention.attention_fn("flash3")


def _patcher(unet):
    """A ComfyUI ModelPatcher over `unet` on the CPU, its BaseModel the smallest stand-in the patcher needs."""
    import comfy.model_patcher

    class Base(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.diffusion_model = unet
    return comfy.model_patcher.ModelPatcher(Base(), torch.device("cpu"), torch.device("cpu"))


def _attention_calls(unet):
    return 2 * sum(type(m).__name__ == "BasicTransformerBlock" for m in unet.modules())


def test_comfy_host_hands_the_backend_over_without_replace_patches():
    """No attention replace patch of ours (IPAdapter extends those per block); on current ComfyUI the host's
    own blocks take the backend through its attention override, same output; on ComfyUI 2024 (no override)
    it reaches only the fused blocks, so with fused kernels off it acts nowhere and says so (0 blocks)."""
    import comfy_inproc
    unet = comfy_inproc.tiny_unet(seed=3, std=0.05)
    from sd_accel.hosts.comfyui import accelerate as host, attention_option
    clone, info = host.accelerate(_patcher(unet), host.AccelOptions(False, False, False, "sdpa"))
    to = clone.model_options["transformer_options"]
    assert not to.get("patches_replace")
    n_attn = _attention_calls(unet)
    reaches = attention_option.host_has_override()
    assert info["patched"]["attention_sdpa"] == (len(attention_option.transformer_blocks(unet)) if reaches else 0)
    x, t, ctx = torch.randn(2, 4, 8, 8), torch.tensor([10.0, 500.0]), torch.randn(2, 7, 768)
    with torch.no_grad():
        ref = unet(x, t, context=ctx, transformer_options={})
        before = kernel_report.snapshot()
        out = unet(x, t, context=ctx, transformer_options=to)
    ran = kernel_report.summarize(before, kernel_report.snapshot()).get("attention_sdpa", {"fused": 0})
    assert ran["fused"] == (n_attn if reaches else 0) and n_attn >= 6
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)


def test_another_packs_attention_override_is_kept_in_the_fused_blocks_too():
    """KJNodes' Patch Sage Attention (and its other attention nodes) put their own function at ComfyUI's
    `optimized_attention_override`. The host's blocks then call it, ours or not; the fused transformer blocks must
    too, even where SD Accel's own backend was chosen: one pack's choice for every block, whichever was applied
    first (stock's output: the override here computes what the host would)."""
    import comfy_inproc
    from sd_accel.hosts.comfyui import accelerate as host, attention_option
    unet = comfy_inproc.tiny_unet(seed=3, std=0.05)   # imports ComfyUI
    if not attention_option.host_has_override():
        pytest.skip("ComfyUI 2024 has no attention override")
    calls = []

    def theirs(func, *args, **kwargs):
        calls.append(1)
        return func(*args, **kwargs)
    n_attn = _attention_calls(unet)
    x, t, ctx = torch.randn(2, 4, 8, 8), torch.tensor([10.0, 500.0]), torch.randn(2, 7, 768)
    with torch.no_grad():
        ref = unet(x, t, context=ctx, transformer_options={})
    for order in ("theirs_first", "theirs_last"):
        patcher = _patcher(unet)
        if order == "theirs_first":
            patcher.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = theirs
        clone, info = host.accelerate(patcher, host.AccelOptions(True, False, False, "sdpa"))
        to = clone.model_options["transformer_options"]
        if order == "theirs_last":
            to["optimized_attention_override"] = theirs
        clone.patch_model()
        try:
            assert info["patched"].get("transformer_add_norm"), info["patched"]
            calls.clear()
            before = kernel_report.snapshot()
            with torch.no_grad():
                out = clone.model.diffusion_model(x, t, context=ctx, transformer_options=to)
            ran = kernel_report.summarize(before, kernel_report.snapshot()).get("attention_sdpa", {"fused": 0})
        finally:
            clone.unpatch_model()
        assert len(calls) == n_attn and ran["fused"] == 0, (order, len(calls), n_attn, ran)
        assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), order
