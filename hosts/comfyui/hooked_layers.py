"""Another pack's forward set on the instance of UNet layers for a sampling run.

BrushNet (and packs built like it) sets a `forward` on every layer of every UNet block in its OUTER_SAMPLE wrapper
and, before each call, hands those layers tensors through an attribute (`add_sample_after`) that the forward adds
to the layer's output. Two things follow for SD Accel, both settled at the run's ON_PRE_RUN: after ComfyUI loaded
the model and applied the object patches, after every OUTER_SAMPLE wrapper began, before the first call.
  * An object patch of ours that displaced a hooked module (or a hooked forward) is taken back for as long as this
    load lasts. The pack hooked the modules in the tree when its wrapper ran, which on a model's first load are the
    originals (ComfyUI applies object patches later, inside the run); its per-call tensors go to the modules in the
    tree, and only a hooked module adds them. Our copy in its place would drop them: a wrong image. ComfyUI's own
    unpatch puts the same original back, so its bookkeeping stays true.
  * The run gets no graph: a tensor read from a module attribute is no input a replay would copy in.
Forwards of our own (a stand-in's bound methods, a forward patch) are not another pack's, nor is the module's own
forward set back on its instance (what BrushNet's unhook leaves on every layer after its run).
"""
import logging

from torch import nn

from ...engine.options import strict
from ...engine.patches import fused_modules as fm
from ...engine.patches import patching
from ...engine.patches.forward_patches import is_forward_patch
from ...kernels.errors import first_line
from . import object_patches

log = logging.getLogger("sd_accel")

UNET = "diffusion_model."
CALLBACK_KEY = "sd_accel_hooked_layers"
_REASON = "_sd_accel_hooked_layers"    # on the BaseModel: this run's line, or None


def foreign_forward(module):
    """True when another pack set `forward` on this module's instance."""
    fwd = module.__dict__.get("forward")
    if fwd is None or is_forward_patch(fwd) or fm.own_method_residue(module, "forward"):
        return False
    mixin = module.__dict__.get("sdaccel_mixin")
    if mixin is not None and getattr(fwd, "__func__", None) is fm.mixin_members(mixin).get("forward"):
        return False
    return True


def _hooked_below(original, ours, path):
    """The path of the first module under `original` with another pack's forward that is not also in `ours` (the
    copy standing for it in the tree), or None."""
    if original is ours:
        return None      # shared with the tree: the hook is live
    if foreign_forward(original):
        return path
    theirs = ours._modules if isinstance(ours, nn.Module) else {}
    for name, child in original._modules.items():
        if child is not None:
            found = _hooked_below(child, theirs.get(name), path + "." + name)
            if found:
                return found
    return None


def _displaced_hook(patcher, path, ours):
    """Where our patch at `path` hides a hook another pack set (a path, or None)."""
    original = patcher.object_patches_backup.get(path)
    if original is None:
        return None
    if path.endswith(".forward"):
        owner = patching.get_attr(patcher.model, path[:-len(".forward")])
        plain = fm.is_own_method(original, owner, "forward") or is_forward_patch(original)
        return None if plain else path
    return _hooked_below(original, ours, path) if isinstance(original, nn.Module) else None


def give_way(patcher, is_ours):
    """Takes back our object patches (`is_ours(value)`) under the UNet that hide another pack's forward on a module
    they displaced. Returns [(patch path, hooked module path)]."""
    taken = []
    for path, value in list(patcher.object_patches.items()):
        if not path.startswith(UNET) or not is_ours(value) or path not in patcher.object_patches_backup:
            continue
        try:
            live = patching.get_attr(patcher.model, path)
        except AttributeError:
            continue
        if live is not value:
            continue
        hooked = _displaced_hook(patcher, path, value)
        if hooked:
            patching.set_attr(patcher.model, path, patcher.object_patches_backup[path])
            taken.append((path, hooked[len(UNET):]))
    return taken


def hooked_in_tree(unet, limit=3):
    """Paths (up to `limit`) of the UNet's modules with another pack's forward, and how many there are."""
    found = [name for name, m in unet.named_modules() if "forward" in m.__dict__ and foreign_forward(m)]
    return found[:limit], len(found)


def reason(unet, taken):
    """The run's one line for the report, or None when no other pack's forward is on a UNet layer."""
    paths, n = hooked_in_tree(unet)
    if not n:
        return None
    why = "another pack set the forward of %d UNet layers for this run (%s%s): no graph" % (
        n, ", ".join(paths), ", ..." if n > len(paths) else "")
    if taken:
        why += "; %d of SD Accel's patched blocks give way to the modules it hooked" % len(taken)
    return why


def on_pre_run(patcher):
    """ON_PRE_RUN (current ComfyUI): gives way where our patches hide another pack's hooks, and notes the run's
    line for `run_reason`. One module-level function, marked inert: ComfyUI hands callbacks to the model in
    `transformer_options`, where a new object per clone would make each clone a new graph key."""
    base_model = patcher.model
    try:
        taken = give_way(patcher, object_patches.is_ours)
        why = reason(base_model.diffusion_model, taken)
    except Exception as e:  # noqa: BLE001 - a fault here must not fail the user's run: it runs without graphs
        if strict():
            raise
        log.exception("[SD Accel] checking the UNet's layers for other packs' forwards failed")
        why = "the check for other packs' forwards on the UNet failed (%s: %s): no graph" % (
            type(e).__name__, first_line(e))
    base_model.__dict__[_REASON] = why
    if why:
        log.info("[SD Accel] %s", why)


on_pre_run.sd_accel_inert = ("hooked layers",)


def run_reason(base_model):
    """Why this run may not replay graphs because of hooked layers (None: it may)."""
    return base_model.__dict__.get(_REASON)


def install(clone):
    """On current ComfyUI (keyed ON_PRE_RUN callbacks); elsewhere nothing, and no run has a reason."""
    try:
        import comfy.patcher_extension as pe
    except ImportError:
        return
    if hasattr(clone, "add_callback_with_key") and getattr(pe.CallbacksMP, "ON_PRE_RUN", None):
        clone.callbacks.setdefault(pe.CallbacksMP.ON_PRE_RUN, {})[CALLBACK_KEY] = [on_pre_run]
