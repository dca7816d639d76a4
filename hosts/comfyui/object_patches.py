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
blocks are moved to the end of the restore order. ComfyUI 2024 has no such callback, and it patches a loaded
model only once (no per-prompt cycle to save): there the UNet is patched module by module (`fold=False`). On
current ComfyUI, a run's end puts the originals back in the tree early (`originals_between_runs`). A
ControlNet's patcher is made by Accelerated KSampler right before sampling, so no other node can add to it:
folded on both.
"""
import contextlib
import functools
import logging
import weakref

import torch

from ...engine.memory import residency
from ...engine.options import strict
from ...engine.patches import forward_patches, layout_modules, patch_folding, patching
from ...engine.patches import fused_modules as fm
from ...engine.graphs import graph_memory
from ...engine.graphs.graphed_forward import GraphedForward
from ...engine.fp8.plan import plan_fp8
from ...engine.fp8.upcast import plan_upcast
from ...engine.patches.forward_patches import is_forward_patch

log = logging.getLogger("sd_accel")
_BASE = "sdaccel_folded_from"     # set in a folded copy's __dict__ (not a child module): its original
CALLBACK_KEY = "sd_accel_patch_order"


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


def _at_or_under_any(path, paths):
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
    if planner is None:
        theirs = others_paths(clone)
        planner = functools.partial(_unet_planner, fused_kernels, channels_last, fp8, upcast, theirs)
    with contextlib.ExitStack() as ejected:
        for other in _injected_clones(clone):
            ejected.enter_context(other.use_ejected())
        return _plan(clone, planner, root, fold)


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
        return {k: v for k, v in planned.items() if not _at_or_under_any(k, theirs)}
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


def _restore_ours_last(patcher):
    """ON_PRE_RUN: when a patch was set inside one of our folded blocks, our blocks go last in the order
    ComfyUI restores patches in. One module-level function: ComfyUI hands the callbacks to the model in
    `transformer_options`, so a new object per clone would make every new clone a new graph key."""
    backup = getattr(patcher, "object_patches_backup", None)
    if not backup:
        return
    folded = [k for k, m in patcher.object_patches.items() if is_folded(m)]
    if any(k not in folded and any(k.startswith(g + ".") for g in folded) for k in patcher.object_patches):
        for g in folded:
            if g in backup:
                backup[g] = backup.pop(g)


_restore_ours_last.sd_accel_inert = ("restore order",)


def can_keep_restore_order(clone):
    """True where ComfyUI has keyed ON_PRE_RUN callbacks (current ComfyUI; not 2024's)."""
    if not hasattr(clone, "add_callback_with_key"):
        return False
    try:
        import comfy.patcher_extension as pe
        return getattr(pe.CallbacksMP, "ON_PRE_RUN", None) is not None
    except ImportError:
        return False


def keep_restore_order(clone, patches):
    """Installs `_restore_ours_last` on `clone` where the host can run it and `patches` (what SD Accel added)
    hold a folded block."""
    if not any(is_folded(m) for m in patches.values()) or not can_keep_restore_order(clone):
        return
    import comfy.patcher_extension as pe
    clone.callbacks.setdefault(pe.CallbacksMP.ON_PRE_RUN, {})[CALLBACK_KEY] = [_restore_ours_last]


def originals_between_runs(patcher):
    """At the end of a sampling run on current ComfyUI: the originals back in the tree where our modules stand (the
    folded blocks, the stand-ins of a block patched module by module, our layer forwards), for as long as the model
    is not sampled. ComfyUI restores and re-applies a loaded model's object patches at its next load (every
    sampler's), from the backup it keeps: this only does that restore early, for our patches and any other pack's
    patch under one of them, last applied first restored (each set undone in reverse, so the tree is the model's
    own whichever of the two was applied first), and drops their backup entries as ComfyUI's restore does (its next
    restore would otherwise set a forward of the host's again, over whatever a pack set there since, or a module of
    our copy into the original). Between prompts the tree is then the model's own. A pack that hooks the modules in
    the tree before ComfyUI loads the model (BrushNet's OUTER_SAMPLE wrapper) otherwise hooked our modules, which
    the next load replaced (another clone's patches, or none for stock's): its samples were set on modules no
    longer in the tree, and the image was another, stock KSampler's too. Left as they are: another pack's patches
    outside ours, the model's sampling object, injected models, and a UNet a VRAM Pool streams. Returns the paths
    restored."""
    backup = getattr(patcher, "object_patches_backup", None)
    model = getattr(patcher, "model", None)
    if not backup or model is None or getattr(patcher, "is_injected", False):
        return []
    unet = getattr(model, "diffusion_model", None)
    if unet is None or residency.streamer_of(unet) is not None:
        return []
    applied = [(k, v) for k, v in patcher.object_patches.items() if k in backup and k.startswith("diffusion_model.")]
    ours = {k for k, v in applied if is_ours(v) and _in_tree(model, k, v)}
    restored = []
    for path, value in reversed(applied):
        if not _at_or_under_any(path, ours) or not _in_tree(model, path, value):
            continue
        _put_back(model, path, backup.pop(path))
        restored.append(path)
    return restored


def _in_tree(model, path, value):
    try:
        return patching.get_attr(model, path) is value
    except AttributeError:
        return False


def _put_back(model, path, original):
    """`original` at `path`; a forward patch's backup that is the module's own class forward bound to it is put back
    as no instance attribute at all (as the host's module had it): a bound method held in the module's own
    `__dict__` is a reference cycle that keeps the layer's weights until a garbage collection runs."""
    parent, _, attr = path.rpartition(".")
    owner = patching.get_attr(model, parent)
    if attr == forward_patches.ATTR and getattr(original, "__self__", None) is owner and \
            getattr(original, "__func__", None) is getattr(type(owner), attr, None):
        delattr(owner, attr)
    else:
        setattr(owner, attr, original)


def _originals_after_run(patcher):
    """ON_CLEANUP (ComfyUI calls it at the end of every sampling run, also one that raised, inside every OUTER_SAMPLE
    wrapper): `originals_between_runs`, a fault logged, never raised into the user's run. One module-level function,
    marked inert (see `_restore_ours_last`)."""
    try:
        originals_between_runs(patcher)
    except Exception as e:  # noqa: BLE001 - the run's result (or its own error) is the user's: keep it
        if strict():
            raise
        log.warning("[SD Accel] the UNet's own blocks could not be put back after the run: %s", e)


_originals_after_run.sd_accel_inert = ("originals between runs",)


def originals_between_runs_on_cleanup(clone):
    """Installs `_originals_after_run` on current ComfyUI (keyed ON_CLEANUP callbacks: another pack's
    `wrappers.update` cannot drop it, as BrushNet's drops the OUTER_SAMPLE wrappers set before its own)."""
    if not can_keep_restore_order(clone):
        return
    import comfy.patcher_extension as pe
    if getattr(pe.CallbacksMP, "ON_CLEANUP", None):
        clone.callbacks.setdefault(pe.CallbacksMP.ON_CLEANUP, {})[CALLBACK_KEY] = [_originals_after_run]


def calls_on_detach(patcher):
    """Whether this ComfyUI calls ON_DETACH callbacks (0.3.x): its word for when it unloads a model."""
    return hasattr(patcher, "add_callback_with_key")


def no_detach_reason(patcher, what):
    """Why no call of `what` (a model's name for the message) may keep a graph on this ComfyUI, or None: a graph's
    memory must go when ComfyUI unloads the model to make room for another, and only ON_DETACH says when."""
    if calls_on_detach(patcher):
        return None
    return ("this ComfyUI has no ON_DETACH callbacks: a graph's memory would stay reserved after ComfyUI unloads the "
            "%s (update ComfyUI to 0.3.x)" % what)


def free_graphs_on_unload(patcher, patches):
    """Current ComfyUI: when it detaches `patcher` (it loads another clone of the model, the user's own in a stock
    node, or unloads it), the conv weights of the GraphedForwards among `patches` go back to stock's layout, and
    once the weights have left the GPU their graph memory is freed and given back to the device (older ComfyUI
    has no callbacks: the graphs go when the weights change or the model dies). Returns whether this ComfyUI calls
    ON_DETACH callbacks (False: the caller puts the layout back itself)."""
    forwards = [gf for gf in patches.values() if isinstance(gf, GraphedForward)]
    if not calls_on_detach(patcher):
        return False
    if not forwards:
        return True
    import comfy.patcher_extension as pe
    # A stand-in is one per module and options, shared by every clone made for it (a ControlNet gets a new clone
    # per run): the layout is for the newest clone to put back. An older clone's patcher freed later, in the
    # middle of another run, detaches too (ModelPatcher.__del__); putting the weights back then made the running
    # clone's graphs replay over the other layout
    owner = weakref.ref(patcher)
    for gf in forwards:
        gf.layout_owner = owner

    def on_detach(p, unpatch_all=True, _forwards=tuple(forwards)):
        held = [gf for gf in _forwards if gf.graphs.entries]
        for gf in _forwards:
            gf.graphs.clear_if_offloaded()
            if gf.layout_owner() is p:
                gf.to_stock_layout()
        if held and not any(gf.graphs.entries for gf in held):
            # under cudaMallocAsync the freed graphs' memory stays the driver's until trimmed, and ComfyUI
            # unloaded this model to have that memory
            graph_memory.trim(getattr(p, "load_device", None))
    patcher.add_callback_with_key(pe.CallbacksMP.ON_DETACH, "sd_accel", on_detach)
    return True
