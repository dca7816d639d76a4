"""Patch planning and apply/remove round trips on ComfyUI's real UNetModel (reduced SD1.5 preset)
and ldm-style modules, with the fused kernels running under the Triton interpreter."""
import os
import sys

import pytest  # noqa: E402
import torch  # noqa: E402

from sd_accel.engine.patches import fused_modules as fm  # noqa: E402
from sd_accel.engine.reports import kernel_report  # noqa: E402
from sd_accel.engine.patches import patching  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import comfy_inproc  # noqa: E402


@pytest.fixture(scope="module")
def comfy_unet():
    return comfy_inproc.tiny_unet(seed=0)


def _inputs(batch=2, hw=8):
    g = torch.Generator().manual_seed(2)
    return (torch.randn(batch, 4, hw, hw, generator=g), torch.tensor([500.0, 20.0])[:batch],
            torch.randn(batch, 7, 768, generator=g))


def test_plan_finds_every_target_and_keeps_parameter_names(comfy_unet):
    names_before = [n for n, _ in comfy_unet.named_parameters()]
    plan = patching.plan_patches(comfy_unet, prefix="diffusion_model.")
    assert plan.counts["group_norm_silu"] >= 5      # in_layers, out_layers per ResBlock, final out
    assert plan.counts["group_norm"] >= 1           # SpatialTransformer.norm
    blocks = sum(type(m).__name__ == "BasicTransformerBlock" for m in comfy_unet.modules())
    assert blocks >= 3
    assert plan.counts["layer_norm"] == 3 * blocks  # norm1/2/3 of every transformer block
    assert plan.counts["geglu"] == blocks
    assert all(k.startswith("diffusion_model.") for k in plan.patches)
    assert [n for n, _ in comfy_unet.named_parameters()] == names_before, "planning must not modify the model"
    backup = patching.apply_patches(comfy_unet, {k[len("diffusion_model."):]: v for k, v in plan.patches.items()})
    try:
        assert [n for n, _ in comfy_unet.named_parameters()] == names_before
        for path, mod in backup.items():
            new = patching.get_attr(comfy_unet, path)
            if isinstance(new, fm.SiLUFolded):
                assert isinstance(mod, torch.nn.SiLU)
                continue
            assert isinstance(new, type(mod)), "replacement must stay an instance of the host class"
            for pname, p in mod.named_parameters(recurse=True):
                assert dict(new.named_parameters())[pname] is p, "parameters must be shared, not copied"
    finally:
        patching.restore(comfy_unet, backup)


def test_patched_unet_matches_stock_and_restores(comfy_unet):
    x, t, ctx = _inputs()
    with torch.no_grad():
        ref = comfy_unet(x, t, context=ctx)
    sd_before = {k: v.clone() for k, v in comfy_unet.state_dict().items()}
    plan = patching.plan_patches(comfy_unet)
    before = kernel_report.snapshot()
    backup = patching.apply_patches(comfy_unet, plan.patches)
    with torch.no_grad():
        out = comfy_unet(x, t, context=ctx)
    ran = kernel_report.summarize(before, kernel_report.snapshot())
    assert ran["group_norm_silu"]["fused"] > 0 and ran["geglu"]["fused"] > 0 and ran["layer_norm"]["fused"] > 0
    assert all(e["fallback"] == 0 for e in ran.values()), ran
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 1e-4, rel
    # re-planning an already patched tree changes nothing: same classes, same shared tensors
    again = patching.plan_patches(comfy_unet)
    assert set(again.patches) == set(plan.patches)
    for path, mod in again.patches.items():
        assert type(mod) is type(plan.patches[path])
    patching.restore(comfy_unet, backup)
    assert not any(fm.is_fused(m) for m in comfy_unet.modules())
    assert comfy_unet.state_dict().keys() == sd_before.keys()
    with torch.no_grad():
        assert torch.equal(comfy_unet(x, t, context=ctx), ref)


def test_scale_shift_resblock_keeps_its_silu():
    class ResBlock(torch.nn.Module):
        def __init__(self, scale_shift):
            super().__init__()
            self.use_scale_shift_norm = scale_shift
            self.out_layers = torch.nn.Sequential(torch.nn.GroupNorm(4, 8), torch.nn.SiLU(),
                                                  torch.nn.Dropout(0.0), torch.nn.Conv2d(8, 8, 3, padding=1))
    plan = patching.plan_patches(ResBlock(True))
    assert "out_layers.1" not in plan.patches and plan.patches["out_layers.0"].sdaccel_act is None
    plan = patching.plan_patches(ResBlock(False))
    assert isinstance(plan.patches["out_layers.1"], fm.SiLUFolded)
    assert plan.patches["out_layers.0"].sdaccel_act == "silu"


def test_host_weight_caster_is_used_for_cast_modules():
    gn = torch.nn.GroupNorm(2, 4)
    fused = fm.make_fused_group_norm(gn, None)
    calls = []

    def caster(m, x):
        calls.append(m)
        return m.weight * 2, m.bias
    fm.set_host_weight_caster(caster)
    try:
        x = torch.randn(1, 4, 3, 3)
        fused.comfy_cast_weights = True
        out = fused(x)
        assert calls == [fused]
        ref = torch.nn.functional.group_norm(x, 2, gn.weight * 2, gn.bias, gn.eps)
        assert torch.allclose(out, ref, atol=1e-5)
        assert not getattr(gn, "comfy_cast_weights", False), "the original module must not change"
    finally:
        fm.set_host_weight_caster(None)


def test_channels_last_conversion_keeps_values_and_parameters():
    conv = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.Conv2d(8, 8, 3))
    ids = [id(p) for p in conv.parameters()]
    ref = [p.detach().clone() for p in conv.parameters()]
    assert patching.convert_conv_weights(conv) == 2
    assert patching.convert_conv_weights(conv) == 0
    assert [id(p) for p in conv.parameters()] == ids
    assert all(torch.equal(a, b) for a, b in zip(conv.parameters(), ref))
    assert conv[0].weight.is_contiguous(memory_format=torch.channels_last)


def test_channels_last_conversion_keeps_each_weight_in_its_own_storage():
    """No new storage per weight: freeing the old ones would leave holes among the loaded weights that the
    allocator cannot give back (the soak's reserved/allocated). A weight that is a view into a larger buffer
    (a streamer's ring, a flat load) gets a copy instead: its storage holds other tensors too."""
    conv = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.Conv2d(8, 6, 1))
    ptrs = [m.weight.data_ptr() for m in conv]
    ref = [m.weight.detach().clone() for m in conv]
    patching.convert_conv_weights(conv)
    assert [m.weight.data_ptr() for m in conv] == ptrs
    assert all(torch.equal(m.weight, r) for m, r in zip(conv, ref))
    x = torch.randn(2, 4, 9, 9).to(memory_format=torch.channels_last)
    F = torch.nn.functional
    with torch.no_grad():
        want = F.conv2d(F.conv2d(x.contiguous(), ref[0], conv[0].bias), ref[1], conv[1].bias)
        assert torch.allclose(conv(x), want, atol=1e-5)
    flat = torch.randn(8 * 4 * 9 + 5)
    shared = torch.nn.Conv2d(4, 8, 3, bias=False)
    shared.weight.data = flat[5:].view(8, 4, 3, 3)
    before = flat[:5].clone()
    w_ref = shared.weight.detach().clone()
    patching.convert_conv_weights(shared)
    assert shared.weight.data_ptr() != flat[5:].data_ptr() and torch.equal(flat[:5], before)
    assert torch.equal(shared.weight, w_ref) and shared.weight.is_contiguous(memory_format=torch.channels_last)


def test_stand_ins_are_instances_of_the_host_class_itself(comfy_unet):
    """Packs place their modules by exact class (AnimateDiff: `type(c) == SpatialTransformer`,
    `type(c).__name__ == "ResBlock"`): every stand-in is of its original's very class, its methods bound to
    itself, also in a shallow copy (the folded blocks copy modules along a patch path)."""
    from sd_accel.engine.patches import patch_folding
    live = dict(comfy_unet.named_modules())
    plan = patching.plan_patches(comfy_unet, patching.COMFY_OPS, prefix="diffusion_model.")
    kinds = set()
    for path, new in plan.patches.items():
        orig = live[path[len("diffusion_model."):]]
        kind = fm.kind_of(new)
        if kind == "silu_folded":
            continue
        kinds.add(kind)
        assert type(new) is type(orig) and fm.kind_of(orig) is None, path
        assert new.forward.__self__ is new or new.__dict__.get("_forward").__self__ is new, path
        copy = patch_folding.own_copy(new)
        bound = [v for v in copy.__dict__.values() if hasattr(v, "__self__") and hasattr(v, "__func__")]
        assert bound and all(v.__self__ is copy for v in bound), path
    assert {"group_norm", "layer_norm", "geglu", "resblock", "transformer_block"} <= kinds, kinds


def test_conv_weights_change_layout_both_ways_in_their_own_storage():
    """To channels_last and back, in place: the same storage (graphs captured over the weights keep reading
    them) and the same values."""
    conv = torch.nn.Conv2d(8, 16, 3)
    root = torch.nn.Sequential(conv)
    ptr, values = conv.weight.data_ptr(), conv.weight.detach().clone()
    assert patching.convert_conv_weights(root) == 1
    assert conv.weight.is_contiguous(memory_format=torch.channels_last) and conv.weight.data_ptr() == ptr
    assert patching.convert_conv_weights(root, torch.contiguous_format) == 1
    assert conv.weight.is_contiguous() and conv.weight.data_ptr() == ptr
    assert torch.equal(conv.weight, values)
