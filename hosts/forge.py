"""Stable Diffusion WebUI Forge host: the engine on Forge's own UNet, through Forge's own ModelPatcher.

Forge runs a UNet of its own (backend/nn/unet.py) in a `KModel` in a `UnetPatcher`
(`sd_model.forge_objects.unet`), a ModelPatcher of Forge's making with ComfyUI's method names. Extensions
patch a clone per sampling run in `process_before_every_sampling` and assign it back; Forge puts a
clone's object patches in when it loads the clone (`forge_patch_model`) and the originals back when it
unloads it (another clone of the model loaded, the model moved off the GPU).

* fused kernels: object patches on the clone, from the plan of hosts/forge_plan.py (GroupNorm+SiLU,
  GroupNorm, LayerNorm, GEGLU on Forge's own classes; what stays with Forge and why is there).
* channels_last (CUDA graphs only): conv weights converted in place before a run's first capture (values
  unchanged, kept until the setting or graphs are turned off, or until every key was refused: a failed
  capture puts them back at once); SpatialTransformers kept channels_last.
  Without graphs the step runs on Forge's layout, where its eager kernels are fastest.
* a `group_norm_wrapper` another extension sets after the plan (which folds SiLUs only without one) is
  handed Forge's own norm, with the SiLU after it (`_unfolding`), through the wrapper below.
* CUDA graphs: Forge's `model_function_wrapper` around `KModel.apply_model`, through
  `engine.graphs.step_graphs.StepGraphs` over the KModel (the UNet's weights and the predictor's sigma buffers, which
  Forge swaps for zero-terminal-SNR runs). That is Forge's one wrapper slot: a wrapper another extension set
  before ours is chained (ours runs inside it: Forge's built-in extensions load before user extensions, so
  MultiDiffusion's tiles each run through our step); one set after ours replaces ours, and the UNet's calls
  then take the eager path through hooks around them (hosts/forge_calls.py). Eager under an online LoRA (merged in Forge's forward from tensors it moves
  per run). The graphs' memory is freed when Forge moves the model off the GPU, so its memory manager gets
  it back for the VAE or the next model.
* ControlNet: Forge's built-in ControlNet calls its control model through the hook SD Accel sets on the clone
  (hosts/forge_controlnet.py).
Outside the clone only the conv weights' layout changes (channels_last, in place, values unchanged): the
base patcher, the model's modules and their parameters stay as Forge made them.
"""
import logging
import weakref

import torch

from ..engine.patches import freeu_filter, patching
from ..engine.graphs import eager
from ..engine.graphs.step_graphs import StepGraphs
from . import a1111_unet_hooks, forge_calls, forge_controlnet, forge_plan, webui
from .forge_plan import PREFIX, state_of

log = logging.getLogger("sd_accel")


def kmodel_of(sd_model):
    """Forge's KModel of the loaded SD model, or None (no model, or not Forge's)."""
    unet = getattr(getattr(sd_model, "forge_objects", None), "unet", None)
    kmodel = getattr(unet, "model", None)
    return kmodel if hasattr(kmodel, "diffusion_model") else None


def is_sd_unet(kmodel):
    """SD1.x/SDXL's UNet (the layout the engine's patches and kernels are made for); Forge's other models
    (Flux, SD3, ...) are left to Forge."""
    unet = getattr(kmodel, "diffusion_model", None)
    return all(hasattr(unet, a) for a in ("input_blocks", "middle_block", "output_blocks"))


def _loads_on_cuda(patcher):
    dev = getattr(patcher, "load_device", None)
    return getattr(dev, "type", str(dev)) == "cuda"


def _has_group_norm_wrapper(patcher):
    return "group_norm_wrapper" in patcher.model_options.get("transformer_options", {})


def _has_online_lora(patcher):
    fn = getattr(patcher, "has_online_lora", None)
    return bool(fn()) if fn is not None else False


# Forge builds its Linears from its own operations class (casting, offloading, its own LoRA path), which the A1111
# host's FP8 forward does not know: not offered until it is checked on a real Forge
FP8_REFUSAL = "not offered on Forge (its own Linear class): fp16"


def _summary(patches, skipped, fold, wrapper, graphs, options=None):
    counts = webui.replacement_counts(patches)
    fp8 = options is not None and options.fp8()
    return {"patched": sum(counts.values()), "counts": counts, "paths": sorted(patches),
            "fold_silu": fold, "skipped": {why: len(p) for why, p in skipped.items()},
            "wrapper": wrapper, "cuda_graph": graphs, "precision": "fp16",
            "reasons": {"precision fp8": FP8_REFUSAL} if fp8 else {}}


def _plan_run(st, patcher, options):
    """(patches, info) that `options` give for `patcher`'s next run (nothing applied)."""
    kmodel = patcher.model
    unet = kmodel.diffusion_model
    if not options.want("fused_kernels") and not options.want("channels_last"):
        return {}, {}, False
    if not forge_plan.plan_for(st, unet):
        return {}, {"the UNet already holds replacements SD Accel did not plan": ["*"]}, False
    fold = not _has_group_norm_wrapper(patcher)
    # channels_last only for graphs: a step without them runs fastest on the layout Forge uses
    layout = (options.want("channels_last") and options.want("cuda_graph") and _loads_on_cuda(patcher)
              and not _has_online_lora(patcher))
    patches, skipped = forge_plan.run_patches(st, patcher, unet, fold, layout)
    if not options.want("fused_kernels"):
        patches = {p: m for p, m in patches.items() if p in st.layout}
    return patches, skipped, fold


def prepare(sd_model, options):
    """At model load: plans, and says what each generation will patch (`status`). Changes nothing."""
    kmodel = kmodel_of(sd_model)
    if kmodel is None:
        return None
    st = state_of(kmodel)
    if not is_sd_unet(kmodel):
        st.last = _summary({}, {"not an SD1.x/SDXL UNet": ["*"]}, False, None, False)
        return st.last
    patches, skipped, fold = _plan_run(st, sd_model.forge_objects.unet, options)
    st.last = _summary(patches, skipped, fold, None, options.want("cuda_graph"), options)
    return st.last


def _strip(clone):
    """Removes our object patches and wrapper from `clone` (one of ours cloned again: the hires pass)."""
    for k in [k for k, v in clone.object_patches.items() if forge_plan.is_ours(v)]:
        del clone.object_patches[k]
    forge_controlnet.strip(clone)
    w = clone.model_options.get("model_function_wrapper")
    if getattr(w, "sd_accel_step", None) is not None:
        prev = w.sd_accel_prev
        if prev is None:
            del clone.model_options["model_function_wrapper"]
        else:
            clone.model_options["model_function_wrapper"] = prev


def strip(unet_patcher):
    """`unet_patcher` without SD Accel: itself when it has nothing of ours, else a clone without it. Conv
    weights an earlier run put in channels_last go back to Forge's layout (SD Accel turned off)."""
    if is_sd_unet(unet_patcher.model):
        st = state_of(unet_patcher.model)
        if st.channels_last:
            _layout_back(st, unet_patcher.model.diffusion_model, "SD Accel off: %d conv weights converted back")
    has = any(forge_plan.is_ours(v) for v in unet_patcher.object_patches.values()) or getattr(
        unet_patcher.model_options.get("model_function_wrapper"), "sd_accel_step", None) is not None or \
        forge_controlnet.is_ours(unet_patcher.model_options.get("transformer_options", {}).get(forge_controlnet.HOOK))
    if not has:
        return unet_patcher
    clone = unet_patcher.clone()
    _strip(clone)
    return clone


def _signature(obj, keep):
    """Identity of everything a patcher holds, down the dicts and lists of its model options: equal
    signatures mean an accelerated clone made from it then would be the same now. Plain values by value;
    other leaves by identity, and kept in `keep` so that no id is reused while the signature is held."""
    if isinstance(obj, dict):
        return tuple((k, _signature(v, keep)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return tuple(_signature(v, keep) for v in obj)
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return ("v", obj)
    keep.append(obj)
    return id(obj)


def _patcher_signature(patcher):
    keep = []
    sig = (_signature(patcher.object_patches, keep), tuple(patcher.lora_patches), _signature(patcher.model_options, keep))
    return sig, keep


def accelerate(unet_patcher, options):
    """(clone of `unet_patcher` with SD Accel applied, info) for `process_before_every_sampling` to assign
    back to `p.sd_model.forge_objects.unet`. `unet_patcher` itself is untouched.

    The clone made for a patcher is handed out again while that patcher holds the same things (Forge gives
    the extensions the same patcher each generation until the LoRA set or the model changes), and so is one
    of ours handed back (the hires pass): Forge then finds that patcher loaded, where a new clone would make
    it unload the model and load it again, a walk over every weight per generation."""
    if not is_sd_unet(unet_patcher.model):
        return unet_patcher, _summary({}, {"not an SD1.x/SDXL UNet": ["*"]}, False, None, False)
    st = state_of(unet_patcher.model)
    st.epoch = object()
    st.runs += 1
    st.run_graphs = not _has_online_lora(unet_patcher)
    if not (options.want("channels_last") and options.want("cuda_graph")) and st.channels_last:
        _layout_back(st, unet_patcher.model.diffusion_model, "channels_last %s: %%d conv weights converted back" % (
            "off" if not options.want("channels_last") else "unused without CUDA graphs"))
    if unet_patcher.__dict__.get("sd_accel_options") == options:
        return unet_patcher, dict(st.last)
    sig, keep = _patcher_signature(unet_patcher)
    cached = st.clones.get(options)
    if cached is not None and cached[0]() is unet_patcher and cached[1] == sig:
        st.last = dict(cached[3])
        return cached[2], dict(st.last)
    clone, info = _accelerate(st, unet_patcher, options)
    st.clones[options] = (weakref.ref(unet_patcher), sig, clone, info, keep)
    return clone, dict(info)


def _accelerate(st, unet_patcher, options):
    clone = unet_patcher.clone()
    _strip(clone)
    patches, skipped, fold = _plan_run(st, clone, options)
    for path, module in patches.items():
        clone.add_object_patch(PREFIX + path, module)
    if patches != st.patches:   # another module set: graphs captured over the previous one do not apply
        st.patches, st.patch_token = patches, object()
    wrapper = None
    folded = any(getattr(m, "sdaccel_act", None) for m in patches.values())
    if options.want("cuda_graph") or options.want("channels_last") or folded:
        wrapper = _install_wrapper(clone, st, options)
        _free_graphs_on_unload(clone, st)
    forge_calls.bracket(clone.model.diffusion_model, st, _layout_back)
    why_not = forge_controlnet.install(clone, st, options, clone.model.diffusion_model)
    clone.sd_accel_options = options
    st.last = _summary(patches, skipped, fold, wrapper, options.want("cuda_graph") and st.run_graphs, options)
    if why_not:
        st.last["reasons"]["controlnet"] = why_not
    return clone, st.last


# -- the step: channels_last, CUDA graphs ---------------------------------------------------------

def _host_state(st, kmodel):
    """What Forge changes without changing the weights' identity: the merged LoRA set (its loader's
    hash), autocast, and the module structure (read once per run: object patches go in before a run's
    first step)."""
    if st.structure[0] is not st.epoch:
        st.structure = (st.epoch, webui.structure_signature(kmodel))
    loader = getattr(kmodel, "lora_loader", None)
    return (getattr(loader, "loaded_hash", None), webui.autocast_state(), st.structure[1], st.patch_token)


def _layout_back(st, unet, why):
    """Conv weights back in Forge's layout; `why` holds a %d for how many."""
    n = patching.convert_conv_weights(unet, torch.contiguous_format)
    st.channels_last = False
    _layout_changed(st, why % n)


def _layout_changed(st, what):
    """Conv weights change layout in their own storage (same pointers, so the weights fingerprint cannot
    tell): graphs captured over the other layout must not replay."""
    log.info("[SD Accel] %s", what)
    if st.graphs is not None:
        st.graphs.clear(what)


def _unfolding(st, gnw):
    """A `group_norm_wrapper` set after the plan (by an extension that ran after ours): Forge's ResBlock then
    calls it with the norm alone and the rest of its Sequential after it, whose SiLU is folded into our
    norm. The wrapper gets Forge's own norm instead, and the SiLU follows it, as without SD Accel. One stable
    object per wrapper (it is part of the graph key)."""
    if st.shim is None or st.shim[0] is not gnw:
        def shim(norm, x, to):
            src = st.unfused.get(norm)
            if src is None:
                return gnw(norm, x, to)
            return torch.nn.functional.silu(gnw(src, x, to))
        st.shim = (gnw, shim)
    return st.shim[1]


def _make_step(st, options, kmodel):
    unet = kmodel.diffusion_model

    def step(apply_model, x, t, c):
        st.wrapper_calls += 1
        with forge_calls.IN_STEP.entered():
            return run_step(apply_model, x, t, c)

    def run_step(apply_model, x, t, c):
        to = c.get("transformer_options")
        if options.want("fused_kernels") and isinstance(to, dict):
            _, c, to = freeu_filter.on_fast_filter((), c, to)    # Forge's built-in FreeU: its filter on our kernel
        gnw = to.get("group_norm_wrapper") if isinstance(to, dict) else None
        if gnw is not None and st.unfused:
            c = dict(c, transformer_options=dict(to, group_norm_wrapper=_unfolding(st, gnw)))
        if not (options.want("cuda_graph") and st.run_graphs):
            # without graphs a host-bound step can be slower on the fused modules than on Forge's: measured per
            # shape, the faster runs (as on ComfyUI)
            if st.eager_paths is None:
                st.eager_paths = eager.EagerPaths()
            key = ("no graphs", tuple(x.shape), x.dtype)
            return st.eager_paths.run(key, apply_model, (x, t), c, x.device)

        def fn(x, t, **kw):
            with webui.capturable_timestep_embedding(unet):
                return apply_model(x, t, **kw)
        if st.graphs is None:
            st.graphs = StepGraphs(kmodel, name="Forge " + type(unet).__name__)
        hooked = a1111_unet_hooks.refusal(unet, st)
        if hooked:
            return st.graphs.run_eager(fn, (x, t), c, hooked)
        out = st.graphs.run(fn, (x, t), c, epoch=st.epoch, host_state=_host_state(st, kmodel),
                            before_capture=to_channels_last)
        if st.channels_last and not st.graphs.may_replay():
            # every key refused (a capture may just have failed): the eager steps run faster in Forge's layout
            _layout_back(st, unet, "no CUDA graph to replay: %d conv weights back in Forge's layout")
        return out

    def to_channels_last():
        """Before a capture, once per run (Forge may have loaded the weights again): conv weights to
        channels_last, values unchanged. True when it changed any (the call then runs eagerly once, compiling
        for the new layout)."""
        if not options.want("channels_last") or st.channels_last_epoch is st.epoch:
            return False
        n = patching.convert_conv_weights(unet)
        st.channels_last_epoch, st.channels_last = st.epoch, True
        if n:
            _layout_changed(st, "channels_last: %d conv weights converted" % n)
        return n > 0
    return step


def _install_wrapper(clone, st, options):
    step = st.steps.get(options)
    if step is None:
        step = st.steps[options] = _make_step(st, options, clone.model)
    prev = clone.model_options.get("model_function_wrapper")

    def model_function_wrapper(apply_model, a):
        if prev is None:
            return step(apply_model, a["input"], a["timestep"], a["c"])
        return prev(lambda x, t, **c: step(apply_model, x, t, c), a)
    model_function_wrapper.sd_accel_step = step
    model_function_wrapper.sd_accel_prev = prev
    clone.set_model_unet_function_wrapper(model_function_wrapper)
    return "model_function_wrapper" + (" (chained)" if prev is not None else "")


def _free_graphs_on_unload(clone, st):
    """When Forge unloads `clone` to its offload device, the graphs' memory goes with the weights. The
    clone is held weakly: Forge frees a loaded patcher nobody else holds by its reference count."""
    ref = weakref.ref(clone)
    original = type(clone).forge_unpatch_model

    def forge_unpatch_model(target_device=None):
        patcher = ref()
        out = original(patcher, target_device)
        if st.graphs is not None:
            st.graphs.clear_if_offloaded()
        return out
    clone.forge_unpatch_model = forge_unpatch_model


# -- status ---------------------------------------------------------------------------------------

def status(sd_model):
    """JSON-able: what each generation patches (as last applied, or planned at model load), per op;
    channels_last; graph counts; keys check."""
    kmodel = kmodel_of(sd_model)
    if kmodel is None:
        return {"model": None, "patched": 0, "counts": {}, "paths": [], "channels_last": False,
                "state_dict_keys_unchanged": True, "graphs": {}, "runs": 0, "wrapper_calls": 0}
    st = state_of(kmodel)
    last = st.last or _summary({}, {}, True, None, False)
    out = dict(last, model=type(kmodel.diffusion_model).__name__, channels_last=st.channels_last,
               state_dict_keys_unchanged=st.keys_ok, runs=st.runs, wrapper_calls=st.wrapper_calls,
               graphs=webui.graph_status(st.graphs))
    out["controlnets"] = forge_controlnet.status()
    out["outside_step"] = forge_calls.status(st)
    return out
