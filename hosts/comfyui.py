"""ComfyUI host: applies the engine's patches to a cloned ModelPatcher, ComfyUI's own reversible way.

* fused kernels: `add_object_patch(path, module)`, undone by ComfyUI on unpatch, folded into one patch per
  top-level block (hosts/comfyui_object_patches.py); replacements honour `comfy.ops.cast_bias_weight` for
  low-VRAM and manual-cast modules;
* channels_last: conv weights converted in place on the first GPU step (values unchanged);
* CUDA graphs: an APPLY_MODEL wrapper under our key where the host has keyed wrappers (current
  ComfyUI), else the single-slot `model_function_wrapper` (ComfyUI 2024), chaining any wrapper another
  pack set there. One `StepGraphs` per loaded model object, so graphs survive across prompts and are
  dropped when the weights change or (current ComfyUI) when the model is unloaded.
Works on ComfyUI 2024-03 and current ComfyUI: host APIs are feature-detected, never assumed.
"""
import logging
from dataclasses import dataclass


from ..engine import attention, fused_modules, patching
from ..engine import cuda_graph
from ..engine.cuda_graph import StepGraphs
from . import comfyui_control_graph as control_graph
from . import comfyui_object_patches as object_patches

log = logging.getLogger("sd_accel")
WRAPPER_KEY = "sd_accel"


@dataclass(frozen=True)
class AccelOptions:
    fused_kernels: bool = True
    cuda_graph: bool = True
    channels_last: bool = True
    attention: str = "auto"     # "auto" keeps the host's own attention

    def any(self):
        return self.fused_kernels or self.cuda_graph or self.channels_last or self.attention != "auto"


def _register_weight_caster():
    try:
        import comfy.ops
        fused_modules.set_host_weight_caster(comfy.ops.cast_bias_weight)
    except Exception as e:  # noqa: BLE001 - an old host without cast_bias_weight: plain weights only
        log.info("[SD Accel] comfy.ops.cast_bias_weight unavailable (%s); low-VRAM casting off", e)


class _ModelState:
    """Per loaded BaseModel: its graphs and whether its conv weights are channels_last."""

    def __init__(self, base_model):
        self.graphs = StepGraphs(base_model.diffusion_model, name=type(base_model).__name__)
        self.channels_last_done = False
        self.wrappers = {}
        self.epoch = None      # set per sampling run by Accelerated KSampler


# Kept in an attribute of the model (a reference cycle the garbage collector frees with it), not in a
# WeakKeyDictionary: the state refers back to the model (graphs, wrappers), and a value that refers to
# its weak key keeps it alive for ever.
_STATE_ATTR = "_sd_accel_state"


def _state(base_model):
    st = base_model.__dict__.get(_STATE_ATTR)
    if st is None:
        st = base_model.__dict__[_STATE_ATTR] = _ModelState(base_model)
        log.log(cuda_graph.DIAG_LEVEL, "[SD Accel] new graph state for model %x", id(base_model))
    return st


def _make_step(st, options, base_model):
    """The function that runs one apply_model call the accelerated way."""
    def step(apply_model, args, kwargs, transformer_options=None):
        x = args[0]
        if options.channels_last and x.is_cuda and not st.channels_last_done:
            n = patching.convert_conv_weights(base_model.diffusion_model)
            st.channels_last_done = True
            log.info("[SD Accel] channels_last: %d conv weights converted", n)
        if options.cuda_graph:
            # one sampling run = one epoch: current ComfyUI gives each run its own sample_sigmas tensor
            to = transformer_options or {}
            epoch = to.get("sample_sigmas", st.epoch)
            # ComfyUI gives every cond a fresh uuid per sampling run; only patches read them, so
            # without patches they must not make each prompt capture anew
            ignore = ("uuids",) if _only_our_patches(to) else ()
            fn, args, kwargs = _with_deferred_control(apply_model, args, kwargs)
            return st.graphs.run(fn, args, kwargs, epoch=epoch, key_ignore=ignore,
                                 host_state=getattr(base_model, "current_weight_patches_uuid", None))
        fn, args, kwargs = _with_deferred_control(apply_model, args, kwargs)
        return cuda_graph.eager_call(fn, args, kwargs)   # first kernels compiled in parallel
    return step


def _with_deferred_control(apply_model, args, kwargs):
    """(fn, args, kwargs) for the graph: a ControlNet chain deferred into this step
    (hosts/comfyui_control_graph.py) becomes graph inputs, and `fn` runs the chain on them before the UNet,
    so both are captured in one graph. Anything else is passed through unchanged."""
    at = 4 if len(args) > 4 else "control"   # keyed wrapper: positional; ComfyUI 2024: a keyword of the cond
    control = args[at] if at == 4 else kwargs.get(at)
    if not isinstance(control, control_graph.DeferredControl):
        return apply_model, args, kwargs
    inputs = control.graph_inputs()
    if at == 4:
        args = args[:4] + (inputs,) + args[5:]
    else:
        kwargs = dict(kwargs, control=inputs)

    def fn(*a, **kw):
        if at == 4:
            a = a[:4] + (control.evaluate(a[4], a[5] if len(a) > 5 else kw.get("transformer_options")),) + a[5:]
        else:
            kw = dict(kw, control=control.evaluate(kw["control"], kw.get("transformer_options")))
        return apply_model(*a, **kw)
    return fn, args, kwargs


def runs_controlnets_in_graph(patched, info):
    """True when the ControlNet chain can be deferred into this accelerated clone's CUDA graph: graphs on,
    a GPU, and its step the first to see apply_model's control (our keyed wrapper outermost, or our
    model_function_wrapper not chained to another pack's, which would get the deferred chain instead of
    residuals)."""
    if not (info.get("options") or {}).get("cuda_graph") or not _loads_on_cuda(patched):
        return False
    if hasattr(patched, "add_wrapper_with_key"):
        if "model_function_wrapper" in patched.model_options:
            return False   # called before apply_model (and its wrappers) with the control in its arguments
        import comfy.patcher_extension as pe
        first = [w for ws in patched.wrappers.get(pe.WrappersMP.APPLY_MODEL, {}).values() for w in ws][:1]
        return bool(first) and getattr(first[0], control_graph.TAKES_DEFERRED, False)
    return info.get("wrapper") == "model_function_wrapper"


def _only_our_patches(to):
    for group in (to.get("patches") or {}).values():
        if any(not getattr(p, "sd_accel_backend", None) for p in group):
            return False
    for group in (to.get("patches_replace") or {}).values():
        if any(not getattr(p, "sd_accel_backend", None) for p in group.values()):
            return False
    return True


def _transformer_blocks(diffusion_model):
    """(block_name, index) of every UNet block holding a transformer, as ComfyUI keys attention patches."""
    def has_transformer(m):
        return any(type(s).__name__ == "SpatialTransformer" for s in m.modules())
    out = []
    for name, blocks in (("input", getattr(diffusion_model, "input_blocks", ())),
                         ("output", getattr(diffusion_model, "output_blocks", ()))):
        out += [(name, i) for i, b in enumerate(blocks) if has_transformer(b)]
    mid = getattr(diffusion_model, "middle_block", None)
    if mid is not None and has_transformer(mid):
        out.append(("middle", 0))
    return out


def _install_attention(clone, backend):
    attend = attention.attention_fn(backend)

    def patch(q, k, v, extra_options):
        return attend(q, k, v, extra_options["n_heads"])
    patch.sd_accel_backend = backend
    blocks = _transformer_blocks(clone.model.diffusion_model)
    for name, i in blocks:
        clone.set_model_attn1_replace(patch, name, i)
        clone.set_model_attn2_replace(patch, name, i)
    return len(blocks)


def _install_wrapper(clone, st, options):
    base_model = clone.model
    step = st.wrappers.get(options)
    if step is None:   # one stable object per (model, options): it is part of the graph key
        step = st.wrappers[options] = _make_step(st, options, base_model)
    if hasattr(clone, "add_wrapper_with_key"):
        import comfy.patcher_extension as pe
        wrapper = st.wrappers.get(("apply_model", options))
        if wrapper is None:
            def wrapper(executor, x, t, c_concat=None, c_crossattn=None, control=None,
                        transformer_options={}, **kwargs):  # noqa: B006 - ComfyUI's own signature
                return step(executor, (x, t, c_concat, c_crossattn, control, transformer_options), kwargs,
                            transformer_options)
            setattr(wrapper, control_graph.TAKES_DEFERRED, True)
            st.wrappers[("apply_model", options)] = wrapper
        clone.wrappers.setdefault(pe.WrappersMP.APPLY_MODEL, {})[WRAPPER_KEY] = [wrapper]
        if hasattr(clone, "add_callback_with_key"):
            on_detach = st.wrappers.get("on_detach")
            if on_detach is None:
                def on_detach(patcher, unpatch_all=True):
                    # ComfyUI also detaches a clone when another clone of the same model is loaded;
                    # the graphs are freed only once the weights have left the GPU
                    st.graphs.clear_if_offloaded()
                st.wrappers["on_detach"] = on_detach
            clone.callbacks.setdefault(pe.CallbacksMP.ON_DETACH, {})[WRAPPER_KEY] = [on_detach]
        return "apply_model wrapper (keyed)"
    prev = clone.model_options.get("model_function_wrapper")
    if getattr(prev, "sd_accel_step", None) is not None:
        prev = getattr(prev, "sd_accel_prev", None)   # re-applying: replace ours, keep what we chained

    def model_function_wrapper(apply_model, a):
        c = dict(a["c"])
        to = c.get("transformer_options")
        if prev is None:
            return step(apply_model, (a["input"], a["timestep"]), c, to)
        return prev(lambda x, t, **kw: step(apply_model, (x, t), kw, kw.get("transformer_options")), a)
    model_function_wrapper.sd_accel_step = step
    model_function_wrapper.sd_accel_prev = prev
    clone.set_model_unet_function_wrapper(model_function_wrapper)
    return "model_function_wrapper" + (" (chained)" if prev is not None else "")


# The patched clone of each input model, per options. ComfyUI re-runs a sampler node on every prompt
# with the same (cached) input ModelPatcher; handing back the same clone means ComfyUI sees the same
# patcher loaded, instead of a new clone that makes it unload the previous one (and drop its graphs).
# Kept in an attribute of the input model, not in a global WeakKeyDictionary: the clone refers to its
# input (`clone.parent`), and a dict value that refers to its weak key keeps it alive for ever (every
# model and LoRA variant ever accelerated would stay in RAM). As an attribute it is a plain reference
# cycle that the garbage collector frees with the input model.
_CLONES_ATTR = "_sd_accel_clones"


def accelerate(model, options):
    """Returns (clone of `model` with SD Accel applied, info dict). `model` itself is untouched."""
    clones = model.__dict__.setdefault(_CLONES_ATTR, {})
    cached = clones.get(options)
    if cached is not None and cached[2] == getattr(model, "patches_uuid", None):
        return cached[0], cached[1]
    clone, info = _accelerate(model, options)
    clones[options] = (clone, info, getattr(model, "patches_uuid", None))
    return clone, info


def _accelerate(model, options):
    clone = model.clone()
    info = {"options": options.__dict__.copy(), "patched": {}, "wrapper": None}
    if not options.any():
        return clone, info
    _register_weight_caster()
    base_model = clone.model
    layout = options.channels_last and _loads_on_cuda(clone)
    object_patches.drop_ours(clone)
    if options.fused_kernels or layout:
        # folded only where the restore order can be kept (current ComfyUI, which re-applies patches per prompt)
        patches, counts = object_patches.plan(clone, options.fused_kernels, layout,
                                                      fold=object_patches.can_keep_restore_order(clone))
        for path, module in patches.items():
            clone.add_object_patch(path, module)
        info["patched"].update(counts)
        info["object_patches"] = len(patches)
        object_patches.keep_restore_order(clone, patches)
    if options.attention != "auto":
        info["patched"]["attention_" + options.attention] = _install_attention(clone, options.attention)
    if options.cuda_graph or options.channels_last:
        st = _state(base_model)
        info["wrapper"] = _install_wrapper(clone, st, options)
        info["graph_state"] = st
    return clone, info


def _loads_on_cuda(patcher):
    """channels_last only pays on a GPU (and only there are conv weights converted): on the CPU the
    host's own modules run, so CPU results stay bit-identical to stock."""
    dev = getattr(patcher, "load_device", None)
    return getattr(dev, "type", str(dev)) == "cuda"


def new_sampling_run(info):
    """Marks the start of a sampling run, so the weights are re-read once for it (see StepGraphs)."""
    st = info.get("graph_state")
    if st is not None:
        st.epoch = object()


def graph_stats(info):
    st = info.get("graph_state")
    return dict(st.graphs.stats) if st is not None else {}
