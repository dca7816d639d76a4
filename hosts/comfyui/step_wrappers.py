"""Where SD Accel's step enters ComfyUI's call chain, and what it hands on to the calls around it.

* current ComfyUI: an APPLY_MODEL wrapper under `WRAPPER_KEY` runs the step; where other packs' DIFFUSION_MODEL
  wrappers (EasyCache's, say) are on a call, the step moves inside them, as the innermost one; an OUTER_SAMPLE
  wrapper guards other packs' model_function_wrappers and puts the conv weights back in stock's layout after each
  run; an ON_DETACH callback frees the graphs once the weights have left the GPU;
* ComfyUI 2024: the single-slot `model_function_wrapper`, chaining the one another pack set;
* a ControlNet chain deferred into the step (hosts/comfyui/control_graph.py) becomes graph inputs, or is run
  eagerly where the step moved inside another pack's wrappers.
Every callable set here is marked inert (`mark_inert`): graph keys take it by its options, whichever object it is.
"""
from ...engine.fp8 import weights as fp8_weights
from . import control_graph
from . import conv_layout
from . import hooked_layers
from . import restore_order
from . import unet_bypass

WRAPPER_KEY = "sd_accel"   # our key in ComfyUI's keyed wrappers and callbacks (the step cache's too)


def mark_inert(fn, options, role):
    """Marks one of our callables for graph keys: it computes what its options say, whichever object it is."""
    fn.sd_accel_inert = (role, options.fused_kernels, options.cuda_graph, options.channels_last, options.attention,
                         options.step_cache, options.step_cache_branch, options.precision, options.fp8_weights)
    return fn


def with_deferred_control(apply_model, args, kwargs):
    """(fn, args, kwargs) for the graph: a ControlNet chain deferred into this step
    (hosts/comfyui/control_graph.py) becomes graph inputs, and `fn` runs the chain on them before the UNet,
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


def foreign_diffusion_wrappers(transformer_options):
    """Other packs' DIFFUSION_MODEL wrappers (EasyCache's, say): Python that runs between apply_model and the
    UNet on every call, often deciding things on GPU values (which a graph cannot), so with them the graph
    covers the UNet call alone, inside those wrappers. Without graphs the step goes inside them too: the eager
    path's choice times a key's first calls, and a call such a wrapper answers from its cache without the UNet
    (~1 ms) would make whichever path it fell on look the faster."""
    wrappers = ((transformer_options or {}).get("wrappers") or {}).get("diffusion_model") or {}
    return [k for k, ws in wrappers.items() if ws and k != WRAPPER_KEY]


def _with_inner_wrapper(transformer_options, inner):
    """A copy of transformer_options whose DIFFUSION_MODEL wrappers end with `inner` (innermost)."""
    to = dict(transformer_options)
    wrappers = dict(to.get("wrappers") or {})
    dm = {k: v for k, v in (wrappers.get("diffusion_model") or {}).items() if k != WRAPPER_KEY}
    dm[WRAPPER_KEY] = [inner]
    wrappers["diffusion_model"] = dm
    to["wrappers"] = wrappers
    return to


def _evaluated(control, transformer_options):
    """A deferred ControlNet chain run here, eagerly (ComfyUI's own code): its residuals."""
    if isinstance(control, control_graph.DeferredControl):
        return control.evaluate(control.graph_inputs(), transformer_options)
    return control


def install(clone, st, options, step):
    """`step` (one apply_model call the accelerated way) set where ComfyUI calls the model: an APPLY_MODEL wrapper
    under our key where the host has keyed wrappers (current ComfyUI), else the single-slot
    `model_function_wrapper` (ComfyUI 2024), chaining any wrapper another pack set there. Returns which, for
    the report."""
    if hasattr(clone, "add_wrapper_with_key"):
        _install_keyed(clone, st, options, step)
        return "apply_model wrapper (keyed)"
    prev = clone.model_options.get("model_function_wrapper")
    if getattr(prev, "sd_accel_step", None) is not None:
        prev = getattr(prev, "sd_accel_prev", None)   # re-applying: replace ours, keep what we chained

    outer = unet_bypass.guarded(prev, st.graphs.refused) if prev is not None else None

    def model_function_wrapper(apply_model, a):
        c = dict(a["c"])
        to = c.get("transformer_options")
        if outer is None:
            return step(apply_model, (a["input"], a["timestep"]), c, to)
        return outer(lambda x, t, **kw: step(apply_model, (x, t), kw, kw.get("transformer_options")), a)
    model_function_wrapper.sd_accel_step = step
    model_function_wrapper.sd_accel_prev = prev
    if prev is None:
        mark_inert(model_function_wrapper, options, "model_function_wrapper")
    clone.set_model_unet_function_wrapper(model_function_wrapper)
    return "model_function_wrapper" + (" (chained)" if prev is not None else "")


def _install_keyed(clone, st, options, step):
    """Current ComfyUI: our APPLY_MODEL wrapper (graphs of the whole apply_model call), which moves the graph
    inside the UNet call where other packs' DIFFUSION_MODEL wrappers run, and an ON_DETACH callback."""
    import comfy.patcher_extension as pe

    def inner(executor, *args, **kwargs):
        to = args[5] if len(args) > 5 else kwargs.get("transformer_options")
        return step(executor, tuple(args), kwargs, to)

    def wrapper(executor, x, t, c_concat=None, c_crossattn=None, control=None,
                transformer_options={}, **kwargs):  # noqa: B006 - ComfyUI's own signature
        if foreign_diffusion_wrappers(transformer_options):
            to = _with_inner_wrapper(transformer_options, inner)
            return executor(x, t, c_concat, c_crossattn, _evaluated(control, to), to, **kwargs)
        return step(executor, (x, t, c_concat, c_crossattn, control, transformer_options), kwargs,
                    transformer_options)
    setattr(wrapper, control_graph.TAKES_DEFERRED, True)
    mark_inert(wrapper, options, "apply_model")
    mark_inert(inner, options, "diffusion_model")
    clone.wrappers.setdefault(pe.WrappersMP.APPLY_MODEL, {})[WRAPPER_KEY] = [wrapper]
    if hasattr(pe.WrappersMP, "OUTER_SAMPLE"):
        def outer_sample(executor, *args, **kwargs):
            # another pack's model_function_wrapper on this run (set before or after ours) is guarded
            unet_bypass.guard_run(getattr(executor.class_obj, "model_options", None), st.graphs.refused)
            # the end of any sampler node's run on this clone (Apply SD Accel then stock KSampler, say):
            # the conv weights back in stock's layout for the nodes that run the model next
            try:
                return executor(*args, **kwargs)
            finally:
                conv_layout.back_to_stock_layout(st)
        mark_inert(outer_sample, options, "outer_sample")
        clone.wrappers.setdefault(pe.WrappersMP.OUTER_SAMPLE, {})[WRAPPER_KEY] = [outer_sample]
    hooked_layers.install(clone)
    restore_order.originals_between_runs_on_cleanup(clone)
    if hasattr(clone, "add_callback_with_key"):
        def on_detach(patcher, unpatch_all=True):
            # ComfyUI also detaches a clone when another clone of the same model is loaded;
            # the graphs are freed only once the weights have left the GPU
            st.graphs.clear_if_offloaded()
            fp8_weights.drop_off_device()
        mark_inert(on_detach, options, "on_detach")
        clone.callbacks.setdefault(pe.CallbacksMP.ON_DETACH, {})[WRAPPER_KEY] = [on_detach]
