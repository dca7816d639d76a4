"""The channels_last SpatialTransformer stand-in on ComfyUI's real SpatialTransformer (CPU): same output
as the host's forward for NCHW and channels_last input, output keeps the input's memory format (the
host's forward returns NCHW), same parameter names and children, planned only where the host forward is
the one it reproduces; on channels_last input its 1x1 proj_in / proj_out run as GEMMs (fp32, fp16, bf16)
with the weights read through ComfyUI's casting; the whole UNet patched the host's way gives stock's
output."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import comfy_inproc  # noqa: E402

from sd_accel.engine.patches import layout_modules  # noqa: E402


@pytest.fixture(scope="module")
def unet(tmp_path_factory):
    return comfy_inproc.tiny_model_patcher(tmp_path_factory.mktemp("ckpt")).model.diffusion_model


def _transformers(unet):
    return [(n, m) for n, m in unet.named_modules() if type(m).__name__ == "SpatialTransformer"]


def _inputs(st, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, st.norm.num_channels, 6, 5, generator=g)
    ctx = torch.randn(2, 7, st.transformer_blocks[0].attn2.to_k.in_features, generator=g)
    return x, ctx


class _CallCounter:
    """Counts calls of a module's own forward (the stand-in's GEMM path must not call it)."""

    def __init__(self, *mods):
        self.calls, self.handles = 0, [m.register_forward_hook(self._hook) for m in mods]

    def _hook(self, *a):
        self.calls += 1

    def remove(self):
        for h in self.handles:
            h.remove()


def test_stand_in_matches_host_forward_and_keeps_channels_last(unet):
    name, st = _transformers(unet)[0]
    new = layout_modules.make_channels_last_spatial_transformer(st)
    assert new is not None and isinstance(new, type(st))
    assert [n for n, _ in new.named_parameters()] == [n for n, _ in st.named_parameters()]
    assert all(a is b for a, b in zip(new.parameters(), st.parameters()))
    assert not st.use_linear and st.proj_in.kernel_size == (1, 1), "SD1.5: 1x1 conv projections"
    x, ctx = _inputs(st)
    with torch.no_grad():
        for xin in (x, x.contiguous(memory_format=torch.channels_last)):
            ref = st(xin, context=ctx, transformer_options={})
            to = {}
            convs = _CallCounter(st.proj_in, st.proj_out)
            try:
                out = new(xin, context=ctx, transformer_options=to)
            finally:
                convs.remove()
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            assert to["block_index"] == len(st.transformer_blocks) - 1
            cl = xin.is_contiguous(memory_format=torch.channels_last)
            assert convs.calls == (0 if cl else 2), "channels_last: both 1x1 convs run as GEMMs"
        assert out.is_contiguous(memory_format=torch.channels_last)
        assert not ref.is_contiguous(memory_format=torch.channels_last), "the host's forward returns NCHW"


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_gemm_projections_in_half_precision(unet, dtype, tol):
    import copy
    st = copy.deepcopy(_transformers(unet)[0][1]).to(dtype)
    new = layout_modules.make_channels_last_spatial_transformer(st)
    x, ctx = _inputs(st, seed=1)
    x = x.to(dtype).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = st(x, context=ctx.to(dtype), transformer_options={})
        out = new(x, context=ctx.to(dtype), transformer_options={})
    assert out.dtype == dtype and out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol * 4, rtol=tol)


def _set_weight_function(conv, fn):
    """A LoRA-style weight hook the way this ComfyUI spells it (a list now, one callable in 2024)."""
    conv.weight_function = [fn] if isinstance(type(conv).weight_function, list) else fn
    if not isinstance(type(conv).weight_function, list):
        conv.comfy_cast_weights = True    # 2024's forward only looks at comfy_cast_weights


def test_gemm_reads_weights_through_the_host_casting(unet):
    """Low-VRAM LoRA: ComfyUI patches weights on the fly through `weight_function`; the GEMMs must see
    the patched weights, as the host's conv forward does."""
    import comfy.ops
    from sd_accel.engine.patches import fused_modules as fm
    name, st = _transformers(unet)[0]
    new = layout_modules.make_channels_last_spatial_transformer(st)
    x, ctx = _inputs(st, seed=2)
    x = x.contiguous(memory_format=torch.channels_last)
    fm.set_host_weight_caster(comfy.ops.cast_bias_weight)
    saved = {m: dict(m.__dict__) for m in (st.proj_in, st.proj_out)}
    try:
        _set_weight_function(st.proj_in, lambda w: w * 0.5)
        _set_weight_function(st.proj_out, lambda w: w + 0.01)
        with torch.no_grad():
            ref = st(x, context=ctx, transformer_options={})
            out = new(x, context=ctx, transformer_options={})
            for m, d in saved.items():
                m.__dict__.clear()
                m.__dict__.update(d)
            plain = st(x, context=ctx, transformer_options={})
    finally:
        fm.set_host_weight_caster(None)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ref, plain, atol=1e-3), "the weight hook must change the result"


def test_other_projections_run_the_module():
    conv = torch.nn.Conv2d(8, 8, 3, padding=1)
    x = torch.randn(1, 8, 4, 4).contiguous(memory_format=torch.channels_last)
    assert layout_modules.gemm_weights(conv, x) is None
    one = torch.nn.Conv2d(8, 4, 1)
    assert layout_modules.gemm_weights(one, x) is not None
    assert layout_modules.gemm_weights(one, x.contiguous()) is None, "NCHW: no contiguous pixel rows"
    for attr, value in (("stride", (2, 2)), ("groups", 2), ("padding", (1, 1))):
        odd = torch.nn.Conv2d(8, 4, 1)
        setattr(odd, attr, value)
        assert layout_modules.gemm_weights(odd, x) is None, attr
    one.parameters_manual_cast = True            # Forge: its own casting, its own forward
    assert layout_modules.gemm_weights(one, x) is None
    w, b = layout_modules.gemm_weights(torch.nn.Conv2d(8, 4, 1), x)
    assert w.shape == (4, 8) and b.shape == (4,)


def test_whole_unet_with_layout_stand_ins_and_comfy_ops_matches_stock(unet):
    """channels_last weights and input, the host's order: layout stand-ins first, then the fused modules
    (set through them). (NCHW: test_fused_resblock's whole-UNet test.)"""
    from sd_accel.engine.patches import patching
    x, t, ctx = comfy_inproc.unet_inputs(unet)
    with torch.no_grad():
        ref = unet(x, t, context=ctx)
        layout = layout_modules.plan_layout_patches(unet)
        backups = [patching.apply_patches(unet, layout)]
        patching.convert_conv_weights(unet)
        x = x.contiguous(memory_format=torch.channels_last)
        try:
            backups.append(patching.apply_patches(unet, patching.plan_patches(unet, patching.COMFY_OPS).patches))
            out = unet(x, t, context=ctx)
        finally:
            for backup in reversed(backups):
                patching.restore(unet, backup)
            patching.convert_conv_weights(unet, torch.contiguous_format)
        again = unet(x.contiguous(), t, context=ctx)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(again, ref)


def test_plan_covers_every_transformer_and_leaves_the_tree_alone(unet):
    before = dict(unet.named_modules())
    plan = layout_modules.plan_layout_patches(unet, prefix="diffusion_model.")
    assert sorted(plan) == sorted("diffusion_model." + n for n, _ in _transformers(unet))
    assert dict(unet.named_modules()) == before


def test_an_unknown_host_forward_is_not_replaced():
    class SpatialTransformer(torch.nn.Module):   # same name, another forward: left alone
        def __init__(self):
            super().__init__()
            self.norm = self.proj_in = self.proj_out = torch.nn.Identity()
            self.transformer_blocks = torch.nn.ModuleList()
            self.use_linear = False

        def forward(self, x, context=None):
            return x
    assert layout_modules.make_channels_last_spatial_transformer(SpatialTransformer()) is None
