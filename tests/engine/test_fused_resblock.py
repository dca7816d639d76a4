"""The ResBlock stand-in (conv bias + timestep embedding folded into the GroupNorm) on ComfyUI's real
ResBlocks, CPU, Triton interpreter: same output as the host's _forward in NCHW and channels_last, names and
Parameters shared, planned only for plain ResBlocks, and the whole patched UNet still gives stock's output."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import comfy_inproc  # noqa: E402

from sd_accel.engine import fused_resblock, kernel_report, patching  # noqa: E402


@pytest.fixture(scope="module")
def unet(tmp_path_factory):
    return comfy_inproc.tiny_model_patcher(tmp_path_factory.mktemp("ckpt")).model.diffusion_model.float()


def _resblocks(unet):
    return [(n, m) for n, m in unet.named_modules() if type(m).__name__ == "ResBlock"]


def test_every_plain_resblock_is_planned_and_the_tree_is_left_alone(unet):
    before = dict(unet.named_modules())
    plan = fused_resblock.plan_resblocks(unet, prefix="diffusion_model.")
    blocks = _resblocks(unet)
    assert blocks and sorted(plan) == sorted("diffusion_model." + n for n, m in blocks if not m.updown)
    assert dict(unet.named_modules()) == before


@pytest.mark.parametrize("channels_last", [False, True])
def test_stand_in_matches_the_host_resblock(unet, channels_last):
    name, rb = next((n, m) for n, m in _resblocks(unet) if m.skip_connection.__class__.__name__ != "Identity")
    new = fm_clone(rb)
    assert isinstance(new, type(rb)) and all(a is b for a, b in zip(new.parameters(), rb.parameters()))
    assert [n for n, _ in new.named_parameters()] == [n for n, _ in rb.named_parameters()]
    g = torch.Generator().manual_seed(0)
    c = rb.in_layers[0].num_channels
    x = torch.randn(2, c, 6, 5, generator=g)
    emb = torch.randn(2, rb.emb_layers[-1].in_features, generator=g)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    k0 = kernel_report.snapshot()
    with torch.no_grad():
        ref = rb(x, emb)
        out = new(x, emb)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    ran = kernel_report.summarize(k0, kernel_report.snapshot())
    assert ran["resblock_add_norm"]["fused"] == 1, ran


def fm_clone(rb):
    from sd_accel.engine import fused_modules as fm
    return fm.clone_as(fused_resblock.FusedResBlock, rb)


def test_whole_unet_with_comfy_ops_matches_stock(unet):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 8, 8, generator=g)
    t = torch.tensor([500.0, 20.0])
    ctx = torch.randn(2, 7, unet.input_blocks[1][1].transformer_blocks[0].attn2.to_k.in_features, generator=g)
    with torch.no_grad():
        ref = unet(x, t, context=ctx)
        plan = patching.plan_patches(unet, patching.COMFY_OPS)
        assert plan.counts["resblock_add_norm"] >= 4
        backup = patching.apply_patches(unet, plan.patches)
        try:
            out = unet(x, t, context=ctx)
        finally:
            patching.restore(unet, backup)
        again = unet(x, t, context=ctx)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(again, ref)


def test_scale_shift_and_up_down_blocks_are_not_planned(unet):
    rb = next(m for _, m in _resblocks(unet))
    assert fused_resblock.eligible(rb)
    for attr in ("use_scale_shift_norm", "updown", "skip_t_emb", "exchange_temb_dims"):
        old = getattr(rb, attr)
        setattr(rb, attr, True)
        try:
            assert not fused_resblock.eligible(rb), attr
        finally:
            setattr(rb, attr, old)
