"""The ResBlock stand-in (conv bias + timestep embedding folded into the GroupNorm; the last conv's bias
and the skip conv's folded into the residual add) on ComfyUI's real ResBlocks, CPU, Triton interpreter:
same output as the host's _forward in NCHW and channels_last, with a conv or identity skip, in fp32,
fp16 and bf16; names and Parameters shared; planned only for plain ResBlocks; a training-mode Dropout
runs the host's steps; and the whole patched UNet still gives stock's output."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import comfy_inproc  # noqa: E402

from sd_accel.engine.patches import fused_resblock, patching  # noqa: E402
from sd_accel.engine.reports import kernel_report  # noqa: E402


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


def _block_inputs(rb, channels_last, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rb.in_layers[0].num_channels, 6, 5, generator=g)
    emb = torch.randn(2, rb.emb_layers[-1].in_features, generator=g)
    return (x.contiguous(memory_format=torch.channels_last) if channels_last else x), emb


@pytest.mark.parametrize("skip", ["conv", "identity"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_stand_in_matches_the_host_resblock(unet, channels_last, skip):
    name, rb = next((n, m) for n, m in _resblocks(unet)
                    if (type(m.skip_connection).__name__ != "Identity") == (skip == "conv"))
    new = fm_clone(rb)
    assert isinstance(new, type(rb)) and all(a is b for a, b in zip(new.parameters(), rb.parameters()))
    assert [n for n, _ in new.named_parameters()] == [n for n, _ in rb.named_parameters()]
    x, emb = _block_inputs(rb, channels_last)
    if channels_last:
        for conv in (rb.in_layers[-1], rb.out_layers[-1], rb.skip_connection):
            if isinstance(conv, torch.nn.Conv2d):   # as the channels_last option stores them
                conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last)
    k0 = kernel_report.snapshot()
    try:
        with torch.no_grad():
            ref = rb(x, emb)
            out = new(x, emb)
    finally:
        for conv in (rb.in_layers[-1], rb.out_layers[-1], rb.skip_connection):
            if isinstance(conv, torch.nn.Conv2d):
                conv.weight.data = conv.weight.data.contiguous()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    ran = kernel_report.summarize(k0, kernel_report.snapshot())
    assert ran["resblock_add_norm"]["fused"] == 1, ran
    assert ran["resblock_bias_residual"]["fused"] == 1, ran
    if channels_last:
        assert out.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
def test_stand_in_matches_the_host_resblock_in_half_precision(unet, dtype, tol):
    """fp16/bf16 weights and activations, channels_last: the folded adds round once instead of twice."""
    import copy
    name, rb = next((n, m) for n, m in _resblocks(unet) if type(m.skip_connection).__name__ != "Identity")
    rb = copy.deepcopy(rb).to(dtype)
    new = fm_clone(rb)
    x, emb = _block_inputs(rb, True, seed=3)
    with torch.no_grad():
        x, emb = x.to(dtype), emb.to(dtype)
        ref = copy.deepcopy(rb).float()(x.float(), emb.float())
        out = new(x, emb)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol * 4, rtol=tol)


def test_training_mode_dropout_runs_the_host_steps(unet):
    """A Dropout in training mode (p > 0) between the norm and the last conv is not the identity: the
    stand-in then runs the host's own steps for the block's end (here with p = 1: h is zeroed)."""
    import copy
    name, rb = next((n, m) for n, m in _resblocks(unet) if type(m.skip_connection).__name__ != "Identity")
    rb = copy.deepcopy(rb)
    rb.out_layers[2] = torch.nn.Dropout(p=1.0)
    rb.out_layers[2].train()
    new = fm_clone(rb)
    x, emb = _block_inputs(rb, False, seed=5)
    k0 = kernel_report.snapshot()
    with torch.no_grad():
        out = new(x, emb)
        expect = rb.skip_connection(x) + rb.out_layers[3].bias.view(1, -1, 1, 1)   # conv(0) = its bias
    torch.testing.assert_close(out, expect)
    ran = kernel_report.summarize(k0, kernel_report.snapshot())
    assert "resblock_bias_residual" not in ran, ran
    rb.out_layers[2].eval()                       # eval mode: the identity again, folded
    k0 = kernel_report.snapshot()
    with torch.no_grad():
        torch.testing.assert_close(new(x, emb), rb(x, emb), atol=1e-4, rtol=1e-4)
    assert kernel_report.summarize(k0, kernel_report.snapshot())["resblock_bias_residual"]["fused"] == 1


def fm_clone(rb):
    from sd_accel.engine.patches import fused_modules as fm
    return fm.clone_as(fused_resblock.FusedResBlock, rb)


@pytest.mark.parametrize("channels_last", [False, True])
def test_whole_unet_with_comfy_ops_matches_stock(unet, channels_last):
    x, t, ctx = comfy_inproc.unet_inputs(unet)
    with torch.no_grad():
        ref = unet(x, t, context=ctx)
        plan = patching.plan_patches(unet, patching.COMFY_OPS)
        assert plan.counts["resblock_add_norm"] >= 4
        if channels_last:
            patching.convert_conv_weights(unet)
            x = x.contiguous(memory_format=torch.channels_last)
        backup = patching.apply_patches(unet, plan.patches)
        k0 = kernel_report.snapshot()
        emb_linear_calls = []
        hooks = [m.emb_layers[1].register_forward_hook(lambda *a: emb_linear_calls.append(1))
                 for _, m in _resblocks(unet)]
        try:
            out = unet(x, t, context=ctx)
        finally:
            for h in hooks:
                h.remove()
            patching.restore(unet, backup)
            if channels_last:
                patching.convert_conv_weights(unet, torch.contiguous_format)
        ran = kernel_report.summarize(k0, kernel_report.snapshot())
        again = unet(x.contiguous(), t, context=ctx)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(again, ref)
    # the fused ResBlocks' timestep-embedding projections ran as one GEMM (engine/patches/emb_projections.py): no
    # block called its own emb_layers Linear
    assert not emb_linear_calls
    assert ran["resblock_bias_residual"] == {"fused": plan.counts["resblock_add_norm"], "fallback": 0,
                                             "reasons": []}, ran
    # and every transformer block's two residual adds ran inside norm2 / norm3 (fused_transformer_block.py)
    assert ran["transformer_add_norm"] == {"fused": 2 * plan.counts["transformer_add_norm"], "fallback": 0,
                                           "reasons": []}, ran


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


def test_emb_projections_of_all_blocks_equal_each_blocks_own_and_step_aside_while_streamed(unet):
    """The shared projection gives each ResBlock what its emb_layers + conv bias give, computed once per emb
    tensor; while a block streamer's token is on the model (weights arrive block by block), none is made."""
    from sd_accel.engine.patches import emb_projections
    from sd_accel.engine.memory import residency
    standins = list(fused_resblock.plan_resblocks(unet).values())
    shared = standins[0].sdaccel_emb_projections
    assert all(s.sdaccel_emb_projections is shared for s in standins) and len(shared.blocks) == len(standins)
    emb = torch.randn(2, standins[0].emb_layers[1].in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for s in standins:
            own = s.emb_layers(emb).float() + s.in_layers[-1].bias.float()
            got = shared.projection(s, emb)
            torch.testing.assert_close(got, own, atol=1e-5, rtol=1e-5)
        first = shared.projection(standins[0], emb)
        assert first.data_ptr() == shared.projection(standins[0], emb).data_ptr()     # once per emb
        assert shared.projection(standins[0], emb.clone()).data_ptr() != first.data_ptr()
        residency.mark(unet)
        try:
            assert shared.projection(standins[0], emb.clone()) is None
        finally:
            residency.clear(unet)
    assert not emb_projections.batchable(torch.nn.Linear(2, 2))
