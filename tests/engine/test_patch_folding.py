"""engine/patches/patch_folding.py on ComfyUI's real UNetModel (tiny preset, CPU): a folded plan puts the same modules
at the same paths as the plan applied patch by patch, the same forward, shares every tensor, and never
modifies the original tree."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import comfy_inproc  # noqa: E402


def _plan(unet):
    from sd_accel.engine.patches import patching
    return patching.plan_patches(unet, patching.COMFY_OPS, prefix="m.").patches


class _Holder(torch.nn.Module):
    """Stands in for ComfyUI's BaseModel: the UNet under "m", as diffusion_model is under BaseModel."""

    def __init__(self, unet):
        super().__init__()
        self.m = unet


def _tree(root):
    return {n: (type(m), tuple(id(p) for p in m._parameters.values() if p is not None))
            for n, m in root.named_modules()}


def test_folded_plan_equals_the_plan_applied_patch_by_patch():
    from sd_accel.engine.patches import patch_folding, patching
    unet = comfy_inproc.tiny_unet()
    holder = _Holder(unet)
    pristine = _tree(unet)
    children_before = [(m, dict(m._modules)) for m in unet.modules()]
    x, t, ctx = comfy_inproc.unet_inputs(unet)
    with torch.no_grad():
        plan = _plan(unet)
        backup = patching.apply_patches(holder, plan)
        want_tree, want = _tree(unet), unet(x, t, ctx)
        patching.restore(holder, backup)
        assert _tree(unet) == pristine

        plan = _plan(unet)   # fresh stand-ins: folding gives the planned ones dicts of their own
        bases = {"m." + n: m for n, m in unet._modules.items()}
        folded, groups = patch_folding.fold(plan, bases, "m.")
        assert set(folded) == set(groups) and len(folded) < len(plan) / 10, list(folded)
        assert sorted(groups) == sorted(g for g in bases if any(p.startswith(g + ".") for p in plan))
        backup = patching.apply_patches(holder, folded)
        assert _tree(unet) == want_tree, "same module classes and the same parameter objects at every path"
        # the originals were never modified: every original module still has its original children
        changed = [type(m).__name__ for m, kids in children_before if m is not unet   # its own: the swaps
                   and (m._modules.keys() != kids.keys() or any(m._modules[k] is not v for k, v in kids.items()))]
        assert not changed, "originals' children changed: %s" % changed
        got = unet(x, t, ctx)
        patching.restore(holder, backup)
    assert torch.equal(got, want)
    assert _tree(unet) == pristine


def test_a_group_is_left_unfolded_where_asked_or_where_a_path_does_not_run_through_children():
    from sd_accel.engine.patches import patch_folding
    unet = comfy_inproc.tiny_unet()
    plan = _plan(unet)
    bases = {"m." + n: m for n, m in unet._modules.items()}
    out, groups = patch_folding.fold(plan, bases, "m.", exclude={"m.input_blocks"})
    assert "m.input_blocks" not in groups and "m.output_blocks" in groups
    under = [p for p in plan if p.startswith("m.input_blocks.")]
    assert under and all(out[p] is plan[p] for p in under), "the excluded group's patches as planned"
    bad = dict(plan)
    bad["m.output_blocks.0.0.no_such_child.x"] = torch.nn.Identity()
    out, groups = patch_folding.fold(bad, bases, "m.")
    assert "m.output_blocks" not in groups and "m.output_blocks.0.0.no_such_child.x" in out


def test_a_single_patch_or_a_path_outside_the_prefix_is_kept_as_it_is():
    from sd_accel.engine.patches import patch_folding
    unet = comfy_inproc.tiny_unet()
    bases = {"m." + n: m for n, m in unet._modules.items()}
    one = {"m.out.0": torch.nn.Identity(), "other.x": torch.nn.Identity(), "m.time_embed": torch.nn.Identity()}
    out, groups = patch_folding.fold(one, bases, "m.")
    assert out == one and groups == []
