"""The order ComfyUI restores a clone's object patches in, and the model's own blocks back in the tree between runs.

ComfyUI restores patches in the order it applied them. A pack that sets an object patch inside one of SD Accel's
folded blocks (hosts/comfyui/object_patches.py) after Apply SD Accel has it applied inside our copy, and restoring
in ComfyUI's order would put that copy's module back into the original: before each run (ON_PRE_RUN) our blocks go
last in that order. At the end of each run (ON_CLEANUP) the originals are put back in the tree early, so that
between prompts the tree is the model's own. Both need current ComfyUI's keyed callbacks; 2024's has none.
"""
import logging

from ...engine.memory import residency
from ...engine.options import strict
from ...engine.patches import forward_patches, patching
from .object_patches import at_or_under_any, is_folded, is_ours

log = logging.getLogger("sd_accel")
CALLBACK_KEY = "sd_accel_patch_order"


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
        if not at_or_under_any(path, ours) or not _in_tree(model, path, value):
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
