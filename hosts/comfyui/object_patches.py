"""The engine's module swaps as ComfyUI object patches on a clone (a UNet's or a ControlNet's), folded into a few.

Current ComfyUI restores and re-applies a loaded model's object patches at every prompt (`partially_load`):
one patch per swapped module would cost 4.4 ms per SD1.5 prompt on the H200's host (224 patches;
bench/RESULTS.md, "Where a 512² prompt's time goes outside the steps"). So the plan (engine/patches/patching.py,
engine/patches/layout_modules.py) is folded per top-level block
(engine/patches/patch_folding.py): `diffusion_model.input_blocks`, `.middle_block`, `.output_blocks`, `.out` become
patched copies that share every tensor and untouched module with the original, which is never modified
(a ControlNet's: `input_blocks`, `middle_block`, ...).

Planned on the unpatched model: another clone (SD Accel's with other options, or anyone's) may be loaded
right now with its patches applied, so each top-level block is taken as this clone will find it: its own
patch there, else the original that ComfyUI keeps in the clones' shared backup, else the live one; an earlier
SD Accel copy stands for the original it was made from.

Left unfolded, patched module by module: a block under which the clone already has another pack's object
patch (ComfyUI applies that first, to the original; a copy made now would hide it). A pack that adds one later, after
Apply SD Accel, has it set inside our copy; ComfyUI restores patches in the order it applied them, which
would put that copy's module back into the original, so before each run (ON_PRE_RUN, current ComfyUI) our
blocks are moved to the end of the restore order (hosts/comfyui/restore_order.py). ComfyUI 2024 has no such
callback, and it patches a loaded model only once (no per-prompt cycle to save): there the UNet is patched module
by module (`fold=False`). On current ComfyUI, a run's end puts the originals back in the tree early
(`restore_order.originals_between_runs`). A
ControlNet's patcher is made by Accelerated KSampler right before sampling, so no other node can add to it:
folded on both.
"""
import contextlib
import functools
import logging

import torch

from ...engine.patches import layout_modules, patch_folding, patching
from ...engine.patches import fused_modules as fm
from ...engine.graphs.graphed_forward import GraphedForward
from ...engine.fp8.plan import plan_fp8
from ...engine.fp8.upcast import plan_upcast
from ...engine.patches.forward_patches import is_forward_patch
from . import plan_reuse

log = logging.getLogger("sd_accel")
_BASE = "sdaccel_folded_from"     # set in a folded copy's __dict__ (not a child module): its original


_DEVICE_COPY = "sdaccel_device_copy_of"   # on our device copy of a patched model_sampling: the original


def model_sampling_on_device(clone, device):
    """A ModelSampling* node's object patch (v-prediction, zero-SNR, EDM...) is built on the CPU and ComfyUI
    loads only modules with weights, so its sigma tables stay there and every step sends its timestep to the
    CPU and back: a wait for the GPU that no graph can hold. The clone gets a copy with the tables on the
    device (same values), as its own object patch: the node's object is untouched. Returns True when added."""
    ms = clone.object_patches.get("model_sampling")
    if ms is None:
        return False
    tables = [b for m in ms.modules() for b in m._buffers.values() if b is not None]
    device = torch.device(device)
    if not tables or all(b.device.type == device.type and device.index in (None, b.device.index) for b in tables):
        return False
    original = ms.__dict__.get(_DEVICE_COPY, ms)
    copies = {}
    for m in original.modules():
        new = copies[id(m)] = m.__class__.__new__(m.__class__)
        new.__dict__.update(m.__dict__)
        new.__dict__["_buffers"] = {n: None if b is None else b.to(device) for n, b in m._buffers.items()}
    for m in original.modules():
        copies[id(m)].__dict__["_modules"] = {n: copies[id(c)] for n, c in m._modules.items()}
    top = copies[id(original)]
    top.__dict__[_DEVICE_COPY] = original
    clone.add_object_patch("model_sampling", top)
    return True


def is_folded(module):
    """True for a folded copy of a top-level block made here."""
    return getattr(module, "__dict__", {}).get(_BASE) is not None


def _is_ours(module):
    return (fm.is_fused(module) or isinstance(module, (fm.SiLUFolded, GraphedForward)) or is_folded(module)
            or getattr(module, "__dict__", {}).get(_DEVICE_COPY) is not None)


def is_ours(value):
    """True for an object patch value SD Accel made: a module of ours or a forward patch."""
    return _is_ours(value) or is_forward_patch(value)


def others_paths(patcher):
    """The paths of `patcher`'s object patches that are not SD Accel's (modules or forwards), as a set."""
    return {k for k, v in patcher.object_patches.items() if not is_ours(v)}


def _original(module):
    return getattr(module, "__dict__", {}).get(_BASE, module)


def _unpatched(clone, path):
    """The module at `path` (a top-level block) as this clone's patches will start from."""
    if path in clone.object_patches:
        return _original(clone.object_patches[path])
    backup = getattr(clone, "object_patches_backup", None) or {}
    if path in backup:
        return backup[path]
    return _original(patching.get_attr(clone.model, path))


def at_or_under_any(path, paths):
    """True where `path` or one of its parents is in `paths` (a set: one lookup per level of the path)."""
    while path:
        if path in paths:
            return True
        path = path.rpartition(".")[0]
    return False


def _touches(path, group):
    return path == group or path.startswith(group + ".") or group.startswith(path + ".")


def drop_ours(clone):
    """Removes SD Accel's own object patches from `clone` (re-applying SD Accel replaces them); the
    model_sampling copy goes back to the object it copied."""
    for k in [k for k, m in clone.object_patches.items() if _is_ours(m)]:
        original = clone.object_patches[k].__dict__.get(_DEVICE_COPY)
        if original is not None:
            clone.object_patches[k] = original
        else:
            del clone.object_patches[k]


def plan(clone, fused_kernels, channels_last, root="diffusion_model", fold=True, planner=None, fp8=False,
         upcast=None):
    """(ordered {path: module} to add as object patches, counts per op) for the
    UNet (or ControlNet: root "", the patcher's model itself) under `root` in `clone`'s model; `fold=False`:
    one patch per module, as the plan has them; `fp8`: the feed-forward's GEGLU projections in FP8 (LOSSY,
    engine/fp8/plan.py); `upcast`: how fp8-stored weights are upcast, "copies" or "grouped" (lossless,
    engine/fp8/upcast.py; precision.upcast_planned).
    Planned with other loaded clones' injections ejected.
    `planner(view, prefix, live) -> (patches, counts)`: what to plan instead of a UNet's module swaps (a VAE's)."""
    reusable = planner is None and root == "diffusion_model" and not fp8 and not upcast
    if planner is None:
        theirs = others_paths(clone)
        planner = functools.partial(_unet_planner, fused_kernels, channels_last, fp8, upcast, theirs)
    with contextlib.ExitStack() as ejected:
        injected = _injected_clones(clone)
        for other in injected:
            ejected.enter_context(other.use_ejected())
        if not reusable or injected:
            return _plan(clone, planner, root, fold)
        # the plan another clone of this model got for the same inputs: the same modules (plan_reuse.py)
        plan_key = plan_reuse.key(clone, root, (fused_kernels, channels_last, fold), _unpatched,
                                  foreign_patches(clone))
        found = plan_reuse.find(clone.model, plan_key)
        if found is not None:
            return found
        patches, counts = _plan(clone, planner, root, fold)
        plan_reuse.keep(clone.model, plan_key, patches, counts)
        return patches, counts


def _injected_clones(clone):
    """Loaded patchers of `clone`'s model with their injections in place (current ComfyUI's PatcherInjection:
    AnimateDiff inserts its motion modules into the UNet's blocks, in place, while its clone is loaded; a plan
    made then would copy them into our blocks, or plan paths that are gone once they are ejected)."""
    try:
        import comfy.model_management as mm
    except ImportError:
        return []
    out = []
    for loaded in list(getattr(mm, "current_loaded_models", ())):
        other = getattr(loaded, "model", None)
        if other is not None and getattr(other, "model", None) is clone.model and \
                getattr(other, "is_injected", False) and hasattr(other, "use_ejected"):
            out.append(other)
    return out


def foreign_modules_reason(clone, root="diffusion_model"):
    """Why no module swap can be planned on `clone` now, or None: modules of another pack's classes inside the
    UNet once the injections SD Accel can eject are out (ComfyUI 2024's AnimateDiff inserts its motion modules
    while its clone is loaded, with no way to take them out): paths planned among them may not exist, or
    name other modules, once that pack takes them out."""
    with contextlib.ExitStack() as ejected:
        for other in _injected_clones(clone):
            ejected.enter_context(other.use_ejected())
        live = patching.get_attr(clone.model, root) if root else clone.model
        found = sorted({type(m).__name__ for _, m in live.named_modules() if _foreign_class(m)})
    if not found:
        return None
    return ("another pack's modules are inside the UNet (%s): module swaps planned among them could miss or hit "
            "the wrong module once it takes them out" % ", ".join(found[:3]))


def _foreign_class(m):
    """A module of a class neither ComfyUI's, torch's, nor SD Accel's (another pack's)."""
    top = (type(m).__module__ or "").split(".")[0]
    return top not in ("comfy", "comfy_extras", "torch") and not _is_ours(m)


def _unet_planner(fused_kernels, channels_last, fp8, upcast, theirs, view, prefix, live):
    """The UNet's module swaps, planned on `view` (the unpatched blocks), none at or under a path in `theirs` (another
    pack's object patches: its module stands there once ComfyUI applies them, and a patch of ours would replace it
    or be set through it)."""
    def ours_only(planned):
        return {k: v for k, v in planned.items() if not at_or_under_any(k, theirs)}
    patches, counts = {}, {}
    if channels_last:
        # before the fused modules: a SpatialTransformer stand-in must be in place before its children's
        # patches are set through it (ComfyUI applies object patches in insertion order; so does the fold)
        layout = ours_only(layout_modules.plan_layout_patches(view, prefix=prefix))
        patches.update(layout)
        if layout:
            counts["channels_last_transformer"] = len(layout)
    if fused_kernels:
        p = patching.plan_patches(view, patching.COMFY_OPS, prefix=prefix, owner=live)
        p = p.without(set(p.patches) - set(ours_only(p.patches)))
        patches.update(p.patches)
        counts.update(p.counts)
    if upcast:
        kept, _ = plan_upcast(view, prefix, grouped=upcast == "grouped")
        kept = ours_only(kept)
        patches.update(kept)
        for p in kept.values():
            counts[p.sdaccel_kind] = counts.get(p.sdaccel_kind, 0) + 1
    if fp8:
        # after the fused modules: a Linear under a stand-in (GEGLU's proj) is set through it
        linears = ours_only(plan_fp8(view, prefix))
        patches.update(linears)
        if linears:
            counts["fp8_linear"] = len(linears)
    return patches, counts


def _plan(clone, planner, root, fold):
    prefix = root + "." if root else ""
    live = patching.get_attr(clone.model, root) if root else clone.model
    foreign = [k for k, _ in foreign_patches(clone)]
    if root and any(_touches(k, root) and not k.startswith(prefix) for k in foreign):
        view, groups = live, {}      # the module itself replaced by another pack: planned on it, unfolded
    else:
        view = patch_folding.own_copy(live)
        groups = {}
        for name in list(view._modules):
            groups[prefix + name] = view._modules[name] = _unpatched(clone, prefix + name)
    patches, counts = planner(view, prefix, live)
    # forward patches are set on the host's own modules, through whatever stands above them: never folded, and
    # after the module patches (ComfyUI applies object patches in insertion order)
    forwards = {k: v for k, v in patches.items() if is_forward_patch(v)}
    patches = {k: v for k, v in patches.items() if k not in forwards}
    exclude = {g for g in groups if not fold or any(_touches(k, g) for k in foreign)}
    out, folded = patch_folding.fold(patches, groups, prefix, exclude)
    out.update(forwards)
    for g in folded:
        out[g].__dict__[_BASE] = groups[g]
    if exclude and fold:
        log.info("[SD Accel] %d block(s) patched module by module: another pack has object patches under %s",
                 len(exclude), ", ".join(sorted(exclude)))
    return out, counts


def foreign_patches(clone):
    """What of `clone`'s own object patches a plan depends on: other packs' (path, module) pairs."""
    return tuple((k, m) for k, m in clone.object_patches.items() if not _is_ours(m))
