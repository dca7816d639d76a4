"""AUTOMATIC1111 WebUI host: applies the engine's patches to the loaded SD model.

A1111 has no object patches, so the UNet's leaves are swapped in place and swapped back:
* fused kernels: `patching.plan_patches` on `sd_model.model.diffusion_model`, applied with
  `patching.apply_patches` and undone with `patching.restore`. Replacements keep every parameter name,
  so `state_dict()` keys are unchanged and A1111's same-object reload (`load_state_dict(strict=False)`
  on the patched model, when switching between checkpoints of one config) loads every weight; the keys
  are checked before and after each apply and on every model-loaded callback.
* applying is idempotent: A1111 runs the model-loaded callbacks again after a VAE reload and after a
  same-object weight reload, and a second `sync` with the same options changes nothing.
* channels_last: conv weights converted in place (values unchanged) on a CUDA UNet with CUDA graphs on;
  undone on toggle-off (of either).
* calls outside the graph route (graphs off, another "SD Unet", an extension's own UNet forward): the faster
  of the fused and the stock modules, measured per shape, through hooks around the UNet's calls.
* CUDA graphs: through A1111's own UNet hook (hosts/a1111_graph_route.py).
* precision fp8 (LOSSY, opt-in): the FP8 Linear forward set on each feed-forward GEGLU projection's
  instance (hosts/a1111_fp8.py), taken off on fp16, off or remove.
Forge has a host of its own (hosts/forge.py); what both share is in hosts/webui.py.

This module imports nothing from A1111 at import time: the caller passes what it needs (the
`sd_unet` module, an options object), so tests drive it with a stand-in of A1111's API.
"""
import logging

import torch

from ..engine.patches import fused_modules, patching
from ..engine.graphs import eager
from ..engine.fp8 import weights as fp8_weights
from . import a1111_fp8, a1111_lora, unet_call_hooks, webui
from .attached import state_on
from .webui import kernel_summary  # noqa: F401 - the extension script's status route reads it here

log = logging.getLogger("sd_accel")

A1111Options = webui.WebUIOptions


# -- per UNet state -------------------------------------------------------------------------------

class _UnetState:
    def __init__(self, stock_channels_last=False):
        self.backup = {}          # path -> original module (what `restore` puts back)
        self.replacements = {}    # path -> our module
        self.counts = {}
        self.keys = None          # state_dict keys before the first patch
        self.keys_ok = None
        # A1111's --opt-channelslast loads the conv weights channels_last: then they always are
        self.stock_channels_last = stock_channels_last
        self.channels_last = stock_channels_last
        self.graphs = None
        self.epoch = None
        self.structure = None     # (epoch, signature) cache for the graph key
        self.forwards = None      # (epoch, another extension's module forward in the UNet or None), read once a run
        self.fp8 = {}             # path -> (Linear, its FP8 forward): precision fp8 (hosts/a1111_fp8.py)
        self.fp8_reason = None    # why precision fp8 was asked for and not set
        self.route_active = False  # SD Accel's "SD Unet" is the active one (its graph route runs the UNet's calls)
        self.eager_paths = eager.EagerPaths()   # calls outside that route: the faster of fused and stock modules
        self.eager_hooks = None   # unet_call_hooks.CallHooks around those calls


_STATE_ATTR = "_sd_accel_state"


def _state(unet):
    return state_on(unet, _STATE_ATTR, lambda: _UnetState(patching.loaded_channels_last(unet)))


def _on_cuda(unet):
    p = next(unet.parameters(), None)
    return p is not None and p.is_cuda


def _intact(unet, st):
    """Every module we put in place is still there (nobody swapped it out behind us)."""
    for path, mod in st.replacements.items():
        try:
            if patching.get_attr(unet, path) is not mod:
                return False
        except AttributeError:
            return False
    return True


def _skip_host_cast(patches):
    """Leaves out modules whose host casts their weights on the fly (`parameters_manual_cast`: offloaded
    or low-precision weights), with the folded SiLU that goes with a fused norm."""
    cast = [p for p, m in patches.items() if getattr(m, "parameters_manual_cast", False)]
    return webui.drop_with_partners(patches, cast)


def _sync_host_attrs(src, dst):
    """Carries what the host changed on one of the pair over to the other on a swap:
    * A1111's Lora extension keeps its bookkeeping on the module object (`network_current_names`,
      `network_weights_backup`, ...): a LoRA is then neither lost nor applied twice;
    * a Parameter or buffer the host replaced by a new object (`module.to("meta")`, a dtype change
      that cannot be done in place) instead of updating the shared one."""
    for k, v in src.__dict__.items():
        if k.startswith("network_"):
            dst.__dict__[k] = v
    for d in ("_parameters", "_buffers"):
        s, t = src.__dict__.get(d), dst.__dict__.get(d)
        if s is None or t is None:
            continue
        for name, tensor in s.items():
            if name in t and t[name] is not tensor:
                t[name] = tensor


def _lora_pre_hook(module, args):
    """A1111's Lora extension applies norm-layer weights from its own `GroupNorm/LayerNorm.forward`
    patch, which a fused module's forward bypasses: call the same function first."""
    a1111_lora.apply_weights(module)


def _keys(unet):
    return tuple(unet.state_dict().keys())


def apply_fused(unet, ops=patching.ALL_OPS):
    """Swaps the fused modules in; a no-op when they are in place. Returns the counts per op.
    Raises RuntimeError (with the originals back in place) if the swap changed `state_dict()` keys."""
    st = _state(unet)
    if st.replacements and _intact(unet, st):
        return dict(st.counts)
    if st.replacements:
        remove_fused(unet)
    before = _keys(unet)
    plan = patching.plan_patches(unet, ops)
    patches = _skip_host_cast(plan.patches)
    backup = patching.apply_patches(unet, patches)
    after = _keys(unet)
    if after != before:
        patching.restore(unet, backup)
        raise RuntimeError("SD Accel: patching changed the UNet's state_dict keys (%d -> %d); originals restored"
                           % (len(before), len(after)))
    for path, new in patches.items():
        _sync_host_attrs(backup[path], new)
        if fused_modules.is_fused(new) and new.sdaccel_kind in ("group_norm", "layer_norm"):
            new.register_forward_pre_hook(_lora_pre_hook)
    st.backup, st.replacements, st.keys, st.keys_ok = backup, patches, before, True
    st.counts = webui.replacement_counts(patches)
    _bracket_calls(unet, st)
    return dict(st.counts)


# -- the UNet's calls outside the graph route ---------------------------------------------------------

def _bracket_calls(unet, st):
    """Hooks around the UNet's own calls (hosts/unet_call_hooks.py): a call SD Accel's graph route does not run
    (CUDA graphs off, another "SD Unet", an extension that set the UNet's own `forward`, as sd-webui-controlnet
    does) takes the faster of the fused and the stock modules: a host-bound step (SD1.5 at batch 1) is slower
    fused without graphs."""
    if st.eager_hooks is None:
        st.eager_hooks = unet_call_hooks.hook_calls(unet, _path_outside_route)


def _unbracket_calls(st):
    if st.eager_hooks is not None:
        st.eager_hooks.remove()
        st.eager_hooks = None


def _path_outside_route(unet, x):
    st = _state(unet)
    if st.route_active and "forward" not in unet.__dict__:
        return None   # the graph route runs it (its refused keys choose their own path)
    key = ("outside the graph route", tuple(getattr(x, "shape", ())), getattr(x, "dtype", None))
    return st.eager_paths.path_for(key, getattr(x, "device", None))


def remove_fused(unet):
    """Puts the original modules back where ours still stand. Returns how many were restored."""
    st = unet.__dict__.get(_STATE_ATTR)
    if st is None or not st.backup:
        return 0
    back = {}
    for path, orig in st.backup.items():
        mine = st.replacements.get(path)
        try:
            here = patching.get_attr(unet, path)
        except AttributeError:
            continue
        if here is mine:
            _sync_host_attrs(mine, orig)
            back[path] = orig
        else:
            log.warning("[SD Accel] %s was replaced by someone else; left as it is", path)
    patching.restore(unet, back)
    st.backup, st.replacements, st.counts = {}, {}, {}
    _unbracket_calls(st)
    return len(back)


def _set_channels_last(unet, st, on):
    on = on or st.stock_channels_last    # "off" is stock's layout
    if on == st.channels_last:
        return 0
    fmt = torch.channels_last if on else torch.contiguous_format
    n = patching.convert_conv_weights(unet, fmt)
    st.channels_last = on
    log.info("[SD Accel] channels_last %s: %d conv weights converted", "on" if on else "off", n)
    return n


def _set_fp8(unet, st, on):
    if on == bool(st.fp8):
        return
    if on:
        st.fp8 = a1111_fp8.set_forwards(unet)
    else:
        a1111_fp8.take_off(st.fp8)
        st.fp8 = {}
    if st.graphs is not None:
        # new StepGraphs, not just no graphs: each key's next call must be an eager warm-up again (the FP8 kernels
        # compiled and the FP8 weights made outside a capture), which the old one's records would skip
        st.graphs.clear("precision changed")
        st.graphs = None
    log.info("[SD Accel] precision %s: %d FP8 Linear forwards set", "fp8 (LOSSY)" if on else "fp16", len(st.fp8))


def apply(unet, options, ops=patching.ALL_OPS, lowvram=False):
    """Brings `unet` to `options` (idempotent). `lowvram`: A1111 moves the UNet's weights per call (--medvram,
    --lowvram). Returns `status(unet)`."""
    st = _state(unet)
    if options.want("fused_kernels"):
        apply_fused(unet, ops)
    else:
        remove_fused(unet)
    # channels_last serves the graphs: a UNet run without them is faster in stock's layout (on either path)
    _set_channels_last(unet, st, options.want("channels_last") and options.want("cuda_graph") and _on_cuda(unet))
    st.fp8_reason = a1111_fp8.refusal(unet, lowvram) if options.fp8() else None
    _set_fp8(unet, st, options.fp8() and st.fp8_reason is None)
    if not options.want("cuda_graph") and st.graphs is not None:
        st.graphs.clear("CUDA graphs turned off")
    return status(unet)


def remove(unet):
    """Everything back as loaded: original modules and forwards, conv weights in the layout they were loaded in,
    no graphs."""
    n = remove_fused(unet)
    st = unet.__dict__.get(_STATE_ATTR)
    if st is not None:
        _set_channels_last(unet, st, False)
        _set_fp8(unet, st, False)
        if st.graphs is not None:
            st.graphs.clear("SD Accel removed")
    return n


def check_keys(unet):
    """True when `state_dict()` keys are those the UNet had before it was first patched."""
    st = unet.__dict__.get(_STATE_ATTR)
    if st is None or st.keys is None:
        return True
    st.keys_ok = _keys(unet) == st.keys
    return st.keys_ok


def status(unet):
    """JSON-able: which modules are patched (replaced, or their forward set: FP8), per op; precision; channels_last;
    graphs; keys check; why an asked-for mode is not on."""
    if unet is None:
        return {"model": None, "patched": 0, "counts": {}, "paths": [], "channels_last": False, "precision": "fp16",
                "state_dict_keys_unchanged": True, "graphs": {}, "reasons": {}}
    st = unet.__dict__.get(_STATE_ATTR)
    n_ours = sum(1 for m in unet.modules() if fused_modules.is_fused(m))
    counts = dict(st.counts) if st else {}
    if st and st.fp8:
        counts["fp8_linear"] = len(st.fp8)
    out = {"model": type(unet).__name__, "patched": n_ours + (len(st.fp8) if st else 0),
           "counts": counts, "precision": "fp8" if st and st.fp8 else "fp16",
           "reasons": {"precision fp8": st.fp8_reason} if st and st.fp8_reason else {},
           "paths": sorted(st.replacements) if st else [],
           "channels_last": bool(st and st.channels_last),
           "state_dict_keys_unchanged": True if st is None or st.keys_ok is None else st.keys_ok,
           "graphs": webui.graph_status(st.graphs if st else None)}
    if st and st.replacements:   # calls outside the graph route: which path each shape measured faster
        out["outside_graphs"] = {"paths": st.eager_paths.choices(), "stock_calls": st.eager_paths.stock_calls}
        if st.eager_hooks is not None and st.eager_hooks.missing:
            out["reasons"]["outside CUDA graphs"] = st.eager_hooks.missing + ": outside CUDA graphs, the fused modules"
    if st and st.fp8:   # the FP8 weights are VRAM beside the fp16 ones (all derived copies on that GPU)
        weight = next(iter(st.fp8.values()))[0].weight
        out["derived_weight_copies_mib"] = round(fp8_weights.bytes_on(weight.device) / 2 ** 20, 2)
    return out


# -- the SD model --------------------------------------------------------------------------------

def unet_of(sd_model):
    """The ldm/sgm UNet of an A1111 SD model, or None (no model loaded, or not an ldm/sgm model)."""
    inner = getattr(sd_model, "model", None)
    return getattr(inner, "diffusion_model", None)


def sync(sd_model, options, reason=""):
    """Applies or removes per `options` on A1111's loaded model. Returns the status dict; logs one line."""
    unet = unet_of(sd_model)
    if unet is None:
        return status(None)
    st = _state(unet)
    if st.keys is not None and not check_keys(unet):
        log.error("[SD Accel] the UNet's state_dict keys changed since it was patched: restoring originals")
        remove(unet)
    if options.enabled:
        s = apply(unet, options, lowvram=bool(getattr(sd_model, "lowvram", False)))
    else:
        remove(unet)
        s = status(unet)
    fp8_weights.drop_off_device()    # FP8 copies of a model A1111 moved off the GPU (checkpoint switch)
    log.info("[SD Accel] %s: %d modules patched %s, precision %s, channels_last %s, keys unchanged %s",
             reason or "sync", s["patched"], s["counts"], s["precision"], s["channels_last"],
             s["state_dict_keys_unchanged"])
    for what, why in s["reasons"].items():
        log.info("[SD Accel] %s not used: %s", what, why)
    return s


def new_sampling_run(sd_model):
    """Marks a new sampling run: the graph fingerprint re-reads the module tree once for it."""
    unet = unet_of(sd_model)
    if unet is not None:
        _state(unet).epoch = object()
