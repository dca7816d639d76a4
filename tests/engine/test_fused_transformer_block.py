"""The BasicTransformerBlock stand-in (residual adds inside norm2/norm3) on ComfyUI's real blocks, CPU, Triton
interpreter: the host block's output for a plain call, the host's own steps when a patch acts inside the
block, names and Parameters shared, and planned before its children's patches."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import comfy_inproc  # noqa: E402

from sd_accel.engine.patches import fused_modules as fm  # noqa: E402
from sd_accel.engine.patches import fused_transformer_block as ftb  # noqa: E402
from sd_accel.engine.reports import kernel_report  # noqa: E402
from sd_accel.engine.patches import patching  # noqa: E402


@pytest.fixture(scope="module")
def unet(tmp_path_factory):
    return comfy_inproc.tiny_model_patcher(tmp_path_factory.mktemp("ckpt")).model.diffusion_model.float()


def _blocks(unet):
    return [(n, m) for n, m in unet.named_modules() if type(m).__name__ == "BasicTransformerBlock"]


def _inputs(block, seed=0):
    g = torch.Generator().manual_seed(seed)
    dim = block.norm1.normalized_shape[0]
    ctx_dim = block.attn2.to_k.in_features
    return torch.randn(2, 24, dim, generator=g), torch.randn(2, 7, ctx_dim, generator=g)


def _standin(blk):
    new = fm.clone_as(ftb.FusedTransformerBlock, blk)
    new.sdaccel_attn_takes_options = ftb._host_body(type(blk))[1]
    return new


def _host_and_standin(blk, new, x, ctx, to):
    """(host output, stand-in output, kernel report of both calls). ComfyUI 2024's block adds into its input
    in place: each call gets its own copy."""
    k0 = kernel_report.snapshot()
    with torch.no_grad():
        ref = blk(x.clone(), context=ctx, transformer_options=to)
        out = new(x.clone(), context=ctx, transformer_options=to)
    return ref, out, kernel_report.summarize(k0, kernel_report.snapshot())


def test_every_block_is_planned_first_and_shares_its_parameters(unet):
    blocks = _blocks(unet)
    plan = patching.plan_patches(unet, patching.COMFY_OPS)
    paths = list(plan.patches)
    assert plan.counts["transformer_add_norm"] == len(blocks) >= 2
    for name, blk in blocks:
        new = plan.patches[name]
        assert isinstance(new, type(blk)) and all(a is b for a, b in zip(new.parameters(), blk.parameters()))
        assert [n for n, _ in new.named_parameters()] == [n for n, _ in blk.named_parameters()]
        # before its children's patches (the fused norms set through the stand-in)
        assert paths.index(name) < paths.index(name + ".norm2")


def test_plain_call_matches_the_host_block_and_uses_the_fused_add_norm(unet):
    name, blk = _blocks(unet)[0]
    x, ctx = _inputs(blk)
    to = {"block": ("input", 1), "block_index": 0, "patches": {}, "patches_replace": {}}
    ref, out, ran = _host_and_standin(blk, _standin(blk), x, ctx, to)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert ran["transformer_add_norm"]["fused"] == 2, ran


def test_a_patch_inside_the_block_runs_the_host_steps(unet):
    name, blk = _blocks(unet)[0]
    new = _standin(blk)
    x, ctx = _inputs(blk, seed=1)
    seen = []

    def middle(h, extra):
        seen.append(1)
        return h * 0.5
    for to in ({"patches": {"middle_patch": [middle]}},
               {"block": ("input", 1), "block_index": 0,
                "patches_replace": {"attn1": {("input", 1, 0): lambda q, k, v, extra: q}}}):
        ref, out, ran = _host_and_standin(blk, new, x, ctx, to)
        assert torch.equal(out, ref)
        ran = ran["transformer_add_norm"]
        assert ran["fused"] == 0 and ran["fallback"] == 1 and "patch acts inside the block" in ran["reasons"][0]
    assert seen == [1, 1]
    # a replace patch for another block leaves this one plain
    assert ftb._plain_call({"block": ("input", 1), "block_index": 0,
                            "patches_replace": {"attn1": {("output", 7, 0): None}}})


def test_blocks_of_other_shapes_are_not_planned(unet):
    name, blk = _blocks(unet)[0]
    assert ftb.eligible(blk)
    for attr, value in (("ff_in", True), ("is_res", False), ("disable_self_attn", True), ("attn2", None)):
        old = blk.__dict__.get(attr, blk._modules.get(attr))
        if attr == "attn2":
            blk._modules["attn2"] = None
        else:
            setattr(blk, attr, value)
        try:
            assert not ftb.eligible(blk), attr
        finally:
            if attr == "attn2":
                blk._modules["attn2"] = old
            else:
                setattr(blk, attr, old)
    assert not ftb.eligible(torch.nn.Linear(2, 2))


def test_sd_accels_own_attention_backend_keeps_the_fused_path(unet):
    """attention=sdpa (or xformers, sage) hands the backend to the block as a transformer option: the stand-in
    runs it in both attentions and keeps the add+norm fusion; same output as the host's own attention."""
    from sd_accel.engine.patches import attention
    name, blk = _blocks(unet)[0]
    x, ctx = _inputs(blk, seed=2)
    to = {"block": ("input", 1), "block_index": 0, attention.TRANSFORMER_OPTION: attention.attention_fn("sdpa")}
    ref, out, ran = _host_and_standin(blk, _standin(blk), x, ctx, to)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert ran["transformer_add_norm"] == {"fused": 2, "fallback": 0, "reasons": []}, ran
    assert ran["attention_sdpa"]["fused"] == 2, ran      # the stand-in's two attentions


def test_another_packs_replace_patch_wins_over_our_attention_backend(unet):
    """IPAdapter's attn2 replace patch beside our backend: the host's steps run, with its patch."""
    from sd_accel.engine.patches import attention
    name, blk = _blocks(unet)[0]
    x, ctx = _inputs(blk, seed=3)
    calls = []

    def ipadapter_like(q, k, v, extra):
        calls.append(1)
        return attention.sdpa(q, k, v, extra["n_heads"]) * 0.5
    to = {"block": ("input", 1), "block_index": 0, attention.TRANSFORMER_OPTION: attention.attention_fn("sdpa"),
          "patches_replace": {"attn2": {("input", 1): ipadapter_like}}}
    ref, out, ran = _host_and_standin(blk, _standin(blk), x, ctx, to)
    assert torch.equal(out, ref) and calls == [1, 1]
    assert ran["transformer_add_norm"]["fallback"] == 1, ran


class _SharedAttention(torch.nn.Module):
    """Another pack's module in place of a block's attn1 (LayerDiffuse's attention sharing, an object patch): no
    to_q/to_k/to_v of its own, and computes something else than CrossAttention."""

    def __init__(self, inner):
        super().__init__()
        self.inner = [inner]
        self.calls = 0

    def forward(self, h, context=None, value=None, transformer_options=None):
        self.calls += 1
        return self.inner[0](h, context=context, value=value) * 0.5


def test_another_packs_module_in_place_of_an_attention_is_called_beside_our_backend(unet):
    """With SD Accel's attention backend set, the stand-in puts it between the attention's own projections. A
    module of another pack in attn1's place has none (or computes otherwise): it is called as the host calls it,
    and the block's output is the host's."""
    from sd_accel.engine.patches import attention
    name, blk = _blocks(unet)[0]
    new = _standin(blk)
    x, ctx = _inputs(blk, seed=4)
    theirs = _SharedAttention(blk.attn1)
    to = {"block": ("input", 1), "block_index": 0, attention.TRANSFORMER_OPTION: attention.attention_fn("sdpa")}
    blk._modules["attn1"] = theirs     # the stand-in shares the block's children, as ComfyUI's patch sets it
    try:
        ref, out, ran = _host_and_standin(blk, new, x, ctx, to)
    finally:
        blk._modules["attn1"] = theirs.inner[0]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert theirs.calls == 2 and ran["attention_sdpa"]["fused"] == 1, ran   # attn2 alone took the backend


def _wrapped_forward(calls):
    """What LayerDiffuse does to BasicTransformerBlock.forward when it is imported: a functools.wraps wrapper that
    records each call's transformer_options where its attention-sharing modules read them."""
    import functools
    from comfy.ldm.modules.attention import BasicTransformerBlock
    original = BasicTransformerBlock.__dict__["forward"]

    @functools.wraps(original)
    def forward(self, x, context=None, transformer_options={}):  # noqa: B006 - the host's signature
        calls.append(transformer_options)
        return original(self, x, context, transformer_options)
    return forward


def test_a_block_class_whose_forward_another_pack_replaced_gets_no_stand_in(unet, monkeypatch):
    """A stand-in never calls its class's forward. Where another pack put its own there before SD Accel planned
    (LayerDiffuse's wrapper, set at import), the source check read through the wrapper to ComfyUI's source and
    the blocks were planned: the pack's code never ran, and the image was another. Neither a wrapper nor a
    function of another module is planned now, and the plan's line says why."""
    from comfy.ldm.modules.attention import BasicTransformerBlock
    blocks = _blocks(unet)
    assert ftb.eligible(blocks[0][1]) and not fm.foreign_forwards(BasicTransformerBlock)
    calls = []
    monkeypatch.setattr(BasicTransformerBlock, "forward", _wrapped_forward(calls))
    assert fm.foreign_forwards(BasicTransformerBlock) == ["forward"]
    plan = patching.plan_patches(unet, patching.COMFY_OPS)
    assert "transformer_add_norm" not in plan.counts and plan.counts.get("layer_norm"), plan.counts
    why = fm.foreign_forwards_reason(unet, ("BasicTransformerBlock", "ResBlock"))
    assert why == ("another pack replaced BasicTransformerBlock.forward on the class: those modules keep its "
                   "forward, unfused"), why

    def elsewhere(self, x, context=None, transformer_options={}):  # noqa: B006 - the host's signature
        return x
    elsewhere.__module__ = "refdrop_like_pack"
    monkeypatch.setattr(BasicTransformerBlock, "forward", elsewhere)
    assert fm.foreign_forwards(BasicTransformerBlock) == ["forward"] and not ftb.eligible(blocks[0][1])
    monkeypatch.undo()
    assert ftb.eligible(blocks[0][1]) and fm.foreign_forwards_reason(unet, ("BasicTransformerBlock",)) is None
