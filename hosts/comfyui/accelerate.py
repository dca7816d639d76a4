"""ComfyUI host: applies the engine's patches to a cloned ModelPatcher, ComfyUI's own reversible way.

* fused kernels: `add_object_patch(path, module)`, undone by ComfyUI on unpatch, folded into one patch per
  top-level block (hosts/comfyui/object_patches.py); replacements honour `comfy.ops.cast_bias_weight` for
  low-VRAM and manual-cast modules;
* channels_last: conv weights converted in place before the first capture (values unchanged), and back to
  stock's layout after each of our node's sampling runs (converted again at the next run's first step), so
  that other nodes run the loaded model as without SD Accel;
* CUDA graphs: the step (`_make_step`) set where ComfyUI calls the model (hosts/comfyui/step_wrappers.py). One
  `StepGraphs` per loaded model object, so graphs survive across prompts and are dropped when the weights
  change or (current ComfyUI) when the model is unloaded.
* attention: the backend as a transformer option (hosts/comfyui/attention_option.py).
* step cache (DeepCache; LOSSY, opt-in): hosts/comfyui/step_cache.py marks each call of a run full or cached
  before the step, and its own wrappers run the kind.
Works on ComfyUI 2024-03 and current ComfyUI: host APIs are feature-detected, never assumed.
"""
import contextlib
import logging
import weakref

import torch

from ...engine.options import AccelOptions, strict  # noqa: F401  (the nodes build AccelOptions through this module)
from ...engine.fp8 import block_upcast
from ...engine.fp8 import upcast as fp8_upcast
from ...engine.fp8 import weights as fp8_weights
from ...engine.patches import attention, freeu_filter, fused_modules, patching
from ...engine.reports import run_report
from ...engine.graphs.step_graphs import StepGraphs
from ...kernels.errors import first_line
from ..attached import state_on
from . import attention_option
from . import compiled
from . import control_graph
from . import conv_layout
from . import families
from . import hooked_layers
from . import host_casts
from . import object_patches
from . import precision
from . import restore_order
from . import step_cache
from . import step_wrappers
from . import stock_blocks

log = logging.getLogger("sd_accel")
ATTENTION_BACKENDS = attention.BACKENDS   # the nodes' `attention` choices
STEP_CACHE_MODES = step_cache.MODES        # the nodes' `step_cache` choices
FP8_WEIGHTS = fp8_upcast.MODES             # the nodes' `fp8_weights` choices
WHOLE_MODEL = run_report.WHOLE_MODEL       # the reason under which SD Accel left the whole model alone
STEP_CACHE_KEYS = 4                        # graph keys per kind kept with the step cache on


class _ModelState:
    """Per loaded BaseModel: its graphs and whether its conv weights are channels_last. The graphs fingerprint
    the whole BaseModel (its diffusion model and its model_sampling: an object patch of either is seen)."""

    def __init__(self, base_model):
        self.graphs = StepGraphs(base_model, name=type(base_model).__name__,
                                 token_module=base_model.diffusion_model)
        self.channels_last_done = False   # the graphs were captured over channels_last conv weights
        # stock's layout is channels_last (ComfyUI's --force-channels-last): the weights then always are
        self.stock_channels_last = patching.loaded_channels_last(base_model.diffusion_model)
        self.channels_last_now = self.stock_channels_last    # the weights are in that layout now
        self.epoch = None      # set per sampling run by Accelerated KSampler
        self.sampling_placed = None   # the run whose model_sampling placement was checked
        self.stock_blocks = blocks = stock_blocks.StockBlocks()
        model = weakref.ref(base_model)   # no cycle through this state (it holds the graphs' memory)

        def stock_tree():
            m = model()
            return blocks.originals(m.diffusion_model) if m is not None else contextlib.nullcontext()
        self.graphs.eager_paths.stock_scope = stock_tree


_STATE_ATTR = "_sd_accel_state"


def _state(base_model):
    return state_on(base_model, _STATE_ATTR, lambda: _ModelState(base_model))


def _make_step(st, options, base_model, derived_copies=False):
    """The function that runs one apply_model (or diffusion model) call the accelerated way."""
    def to_channels_last():
        """Before a capture: conv weights to channels_last (values unchanged), unless they are already. Only for
        graphs: an eager step (graphs refused for it) runs stock's modules, which are fastest on stock's layout."""
        if not options.channels_last or st.channels_last_now:
            return False
        n = patching.convert_conv_weights(base_model.diffusion_model)
        if not st.channels_last_done:
            log.info("[SD Accel] channels_last: %d conv weights converted", n)
        st.channels_last_done = st.channels_last_now = True
        return n > 0

    def layout_for_graphs():
        """channels_last while the model may replay a graph; stock's layout once every key was refused (a failed
        capture leaves the weights converted, and the run's eager steps are faster in stock's layout)."""
        conv_layout.set_layout(st, base_model,
                               options.channels_last and st.channels_last_done and st.graphs.may_replay())

    def step(call, args, kwargs, transformer_options=None):
        x = args[0]
        fn, args, kwargs = step_wrappers.with_deferred_control(call, args, kwargs)
        why = compiled.in_call(transformer_options, base_model)
        # the run this call belongs to, where the host says it (each run's own sample_sigmas): its stock-path calls
        # may run the blocks' originals, as planned at its first (stock_blocks.py)
        st.stock_blocks.enter_run(None if why else (transformer_options or {}).get("sample_sigmas"))
        if why:   # compiled after SD Accel was applied: the host's own modules, traced by torch.compile
            conv_layout.set_layout(st, base_model, False)
            return st.graphs.run_stock(fn, args, kwargs, why)
        if options.fused_kernels:
            args, kwargs, transformer_options = freeu_filter.on_fast_filter(args, kwargs, transformer_options)
        host_state = getattr(base_model, "current_weight_patches_uuid", None)
        if derived_copies and hooks_patch_weights(base_model):
            # a hook's weight patch is written in place, between the calls of one step, into tensors without a
            # version counter: no copy derived from the weights can tell, so each call makes its copies again
            host_state = (host_state, object())
        # derived weight copies (FP8, upcast fp8-stored weights) are keyed on the host's patch state too, and
        # fp8-stored weights cast a group at a time are cast within the step
        scope = _derived_weights_scope(host_state) if derived_copies else contextlib.nullcontext()
        with scope:
            foreign = options.cuda_graph and (_forward_replaced(base_model) or hooked_layers.run_reason(base_model))
            if foreign:
                st.stock_blocks.enter_run(None)
                conv_layout.set_layout(st, base_model, False)
                return st.graphs.run_eager(fn, args, kwargs, foreign)
            if options.cuda_graph:
                # one sampling run = one epoch: current ComfyUI gives each run its own sample_sigmas tensor
                epoch = (transformer_options or {}).get("sample_sigmas", st.epoch)
                if epoch is None or epoch is not st.sampling_placed:   # loads happen between runs only
                    _model_sampling_on(base_model, x.device)
                    st.sampling_placed = epoch
                    layout_for_graphs()
                out = st.graphs.run(fn, args, kwargs, epoch=epoch, before_capture=to_channels_last,
                                    host_state=host_state, warm_after_change=derived_copies)
                if st.channels_last_now and not st.graphs.entries:   # a capture may just have failed
                    layout_for_graphs()
                return out
            # graphs off: the faster of the fused and the stock modules, measured per shape, on stock's layout
            conv_layout.set_layout(st, base_model, False)
            key = ("no graphs", tuple(x.shape), x.dtype, step_cache.call_kind(transformer_options))
            return st.graphs.eager_paths.run(key, fn, args, kwargs, x.device)
    return step


def _forward_replaced(base_model):
    """Why no graph may run this call, when another pack set the UNet's forward on the instance (WaveSpeed's First
    Block Cache sets `_forward` around each call): its Python-side decisions change from call to call (a cache hit
    read on the host from the second step on), where a key's first, probed calls need not show them. None
    otherwise."""
    own = base_model.diffusion_model.__dict__
    for name in ("_forward", "forward"):
        if name in own:
            return "another pack replaced the UNet's %s (its decisions may change from call to call)" % name
    return None


@contextlib.contextmanager
def _derived_weights_scope(host_state):
    with fp8_weights.host_state(host_state), block_upcast.step():
        yield


def hooks_patch_weights(base_model):
    """Whether current ComfyUI's hooks (Create Hook LoRA and the like, set on conditioning) have weight patches on
    the patcher running this model: it patches them in place before each call whose rows carry the hook."""
    patcher = getattr(base_model, "current_patcher", None)
    return bool(getattr(patcher, "hook_patches", None))


def _model_sampling_on(base_model, device):
    """ComfyUI's partial loads move only the modules that hold weights: after the model was unloaded and loaded
    again, its model_sampling buffers (sigmas, log_sigmas) stay on the CPU, and each step converts its sigma
    there and back through host syncs that no graph can hold. A first load puts them on the GPU with the rest;
    they are put there again, where the UNet runs (the same values: the conversion is an exact lookup). A node's
    ModelSampling object patch gets a device copy when the clone is planned
    (object_patches.model_sampling_on_device); this covers the model's own, which loads move between runs."""
    sampling = getattr(base_model, "model_sampling", None)
    if device.type != "cuda" or not isinstance(sampling, torch.nn.Module):
        return
    if any(b.device != device for b in sampling.buffers()):
        sampling.to(device)


def runs_controlnets_in_graph(patched, info):
    """True when the ControlNet chain can be deferred into this accelerated clone's CUDA graph: graphs on,
    a GPU, and its step the first to see apply_model's control (our keyed wrapper outermost, or our
    model_function_wrapper not chained to another pack's, which would get the deferred chain instead of
    residuals)."""
    if not (info.get("options") or {}).get("cuda_graph") or not _loads_on_cuda(patched) or \
            (info.get("reasons") or {}).get(WHOLE_MODEL):
        return False
    if hasattr(patched, "add_wrapper_with_key"):
        if "model_function_wrapper" in patched.model_options:
            return False   # called before apply_model (and its wrappers) with the control in its arguments
        import comfy.patcher_extension as pe
        first = [w for ws in patched.wrappers.get(pe.WrappersMP.APPLY_MODEL, {}).values() for w in ws][:1]
        return bool(first) and getattr(first[0], control_graph.TAKES_DEFERRED, False)
    return info.get("wrapper") == "model_function_wrapper"


# The patched clone of each input model, per options. ComfyUI re-runs a sampler node on every prompt
# with the same (cached) input ModelPatcher; handing back the same clone means ComfyUI sees the same
# patcher loaded, instead of a new clone that makes it unload the previous one (and drop its graphs).
# Kept in an attribute of the input model, not in a global WeakKeyDictionary: the clone refers to its
# input (`clone.parent`), and a dict value that refers to its weak key keeps it alive for ever (every
# model and LoRA variant ever accelerated would stay in RAM). As an attribute, with the clone's parent set past
# the input (parent_beyond_the_cache), nothing refers back: the clone is freed with its input.
_CLONES_ATTR = "_sd_accel_clones"


def accelerate(model, options):
    """Returns (clone of `model` with SD Accel applied, info dict). `model` itself is untouched."""
    clones = model.__dict__.setdefault(_CLONES_ATTR, {})
    cached = clones.get(options)
    fresh = cached is not None and cached[2] == getattr(model, "patches_uuid", None)
    keep_while_loaded(model, cached[0] if cached is not None and not fresh else None)
    if fresh:
        return cached[0], cached[1]
    try:
        clone, info = _accelerate(model, options)
    except Exception as e:  # noqa: BLE001 - a fault in SD Accel's set-up must not fail the user's prompt
        if strict():
            raise
        clone, info = _stock_clone_after(e, model, options)
    clones[options] = (clone, info, getattr(model, "patches_uuid", None))
    return clone, info


def _stock_clone_after(error, model, options):
    """A plain clone of `model` (it runs as stock) and an info whose whole-model reason names `error`, for a set-up
    that raised: the half-patched clone is dropped, the traceback logged for a bug report. Kept in the cache like a
    patched clone: the same input and options would fail the same way on every prompt."""
    log.exception("[SD Accel] setting up the model failed; it runs as stock")
    clone = model.clone()
    parent_beyond_the_cache(clone, model)
    why = "SD Accel's set-up failed (%s: %s): this model runs as stock" % (type(error).__name__, first_line(error))
    return clone, {"options": options.__dict__.copy(), "patched": {}, "wrapper": None,
                   "reasons": {run_report.WHOLE_MODEL: why}}


_RETIRED_ATTR = "_sd_accel_retired_clones"


def keep_while_loaded(model, old_clone=None):
    """A cached clone replaced (`old_clone`: its input's patches changed in place) while ComfyUI still has it loaded
    is kept, on its input, until ComfyUI has let go of it (checked on each call for the input): freed while loaded, with
    no parent to fall back to (a root input's clone has none: parent_beyond_the_cache), its loaded entry would
    outlive it beside its live BaseModel, which ComfyUI takes for a leak (a full garbage collection on every
    later load)."""
    kept = list(model.__dict__.get(_RETIRED_ATTR, ()))
    if old_clone is not None:
        kept.append(old_clone)
    if not kept:
        return
    try:
        import comfy.model_management as mm
    except ImportError:
        return
    loaded = {id(lm.model) for lm in list(getattr(mm, "current_loaded_models", ()))}
    model.__dict__[_RETIRED_ATTR] = [c for c in kept if id(c) in loaded]


# the host classes whose methods SD Accel's stand-ins re-implement (engine/patches: fused_transformer_block,
# fused_resblock, layout_modules)
_STANDS_IN_FOR = ("BasicTransformerBlock", "ResBlock", "SpatialTransformer")


def _accelerate(model, options):
    clone = model.clone()
    parent_beyond_the_cache(clone, model)
    info = {"options": options.__dict__.copy(), "patched": {}, "wrapper": None, "reasons": {}}
    if not options.any():
        return clone, info
    object_patches.drop_ours(clone)
    why = compiled.reason(clone) or families.unsupported_reason(clone)
    if why:
        info["reasons"][run_report.WHOLE_MODEL] = why
        log.info("[SD Accel] %s", why)
        return clone, info
    host_casts.register()
    base_model = clone.model
    layout = options.channels_last and _loads_on_cuda(clone)
    fp8 = precision.fp8_planned(clone, options, info)
    upcast = precision.upcast_planned(clone, info, _loads_on_cuda(clone), options.fp8_weights)
    if options.fused_kernels or layout or fp8 or upcast:
        # folded only where the restore order can be kept (current ComfyUI, which re-applies patches per prompt)
        why = object_patches.foreign_modules_reason(clone)
        if why:
            info["reasons"]["fused kernels"] = why
            if fp8:
                info["reasons"]["precision fp8"] = why
            patches, counts = {}, {}
        else:
            patches, counts = object_patches.plan(clone, options.fused_kernels, layout,
                                                  fold=restore_order.can_keep_restore_order(clone), fp8=fp8,
                                                  upcast=upcast)
        for path, module in patches.items():
            clone.add_object_patch(path, module)
        why = fused_modules.foreign_forwards_reason(base_model.diffusion_model, _STANDS_IN_FOR)
        if why:
            info["reasons"]["another pack's forwards"] = why
            log.info("[SD Accel] %s", why)
        info["patched"].update(counts)
        info["object_patches"] = len(patches)
        restore_order.keep_restore_order(clone, patches)
    if options.attention != "auto":
        n, why = attention_option.install(clone, options.attention, options)
        info["patched"]["attention_" + options.attention] = n
        if why:
            info["reasons"]["attention_" + options.attention] = why
    if options.cuda_graph and _loads_on_cuda(clone) and \
            object_patches.model_sampling_on_device(clone, clone.load_device):
        info["patched"]["model_sampling_on_gpu"] = 1
    cache = step_cache.install(clone, options, info)
    if options.fused_kernels or options.cuda_graph or options.channels_last or fp8 or upcast or cache is not None:
        # also with fused kernels alone: where a step runs eagerly it takes the faster of fused and stock
        st = _state(base_model)
        if cache is not None:   # each kind of call is its own key: room for both kinds of each shape
            st.graphs.max_graphs = max(st.graphs.max_graphs, 2 * STEP_CACHE_KEYS)
        step = _make_step(st, options, base_model, precision.keeps_derived_copies(clone, fp8, upcast))
        if cache is not None:   # the step cache decides each call's kind before the step (hosts/comfyui/step_cache.py)
            step = cache.wrap(step, step_wrappers.foreign_diffusion_wrappers)
        info["wrapper"] = step_wrappers.install(clone, st, options, step)
        info["graph_state"] = st
    return clone, info


def parent_beyond_the_cache(clone, model):
    """The clone's `parent` (whom current ComfyUI's LoadedModel falls back to when the clone is freed while loaded)
    skips its input, which holds the clone (_CLONES_ATTR): a clone that referred back to it would make a cycle,
    freed only by a garbage collection. Until one ran, a model the user's graph had dropped kept its weights; and
    a collection inside ComfyUI's free_memory (any allocation there can start one) freed a patcher its unload loop
    had already listed, which failed on it (`.model` None) and left the loaded list broken for every later
    prompt. So the parent is the input's parent, or none for a root input (a checkpoint loader's model): the
    clone is freed with its input, by reference counting, and its BaseModel with them, which drops ComfyUI's
    loaded entry (its finalizer), as stock's loader output is freed."""
    if getattr(clone, "parent", None) is model:
        clone.parent = getattr(model, "parent", None)


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


def graph_counts(info):
    """The UNet's graph counters so far ({} without graphs), refusals as {reason: calls}."""
    st = info.get("graph_state")
    if st is None:
        return {}
    return dict(st.graphs.stats, stock_path=st.graphs.eager_paths.stock_calls, refused=dict(st.graphs.refused),
                eager_reason=st.graphs.last_eager_reason, eager_paths=st.graphs.eager_paths.choices())


def graph_delta(before, after):
    """What one run added to the counters of `graph_counts` (the last eager reason as it is after it)."""
    if not after:
        return {}
    out = {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, int)}
    was = before.get("refused", {})
    out["refused"] = {r: n - was.get(r, 0) for r, n in after["refused"].items() if n > was.get(r, 0)}
    if not out.get("replays"):
        out["eager_reason"] = after.get("eager_reason")
    if after.get("eager_paths"):
        out["eager_paths"] = after["eager_paths"]
    return out
