"""Forge host, ControlNet side: Forge's built-in ControlNet runs its control model with SD Accel's fused modules
and, on CUDA, replays it from CUDA graphs.

Forge calls a ControlNet's control model in `get_control` (backend/patcher/controlnet.py) through the UNet
patcher's transformer option `controlnet_model_function_wrapper` when one is set (Forge's own hook,
`UnetPatcher.set_controlnet_model_function_wrapper`). SD Accel sets it on its clone of the UNet patcher, the one the
run samples with: Forge's built-in extensions load before user extensions, so its ControlNet script has added its
ControlNets to the patcher SD Accel clones, and `get_control` reads the hook from the run's transformer options.
The hook (`wrapper_for`) runs:
* a full ControlNet (Forge's own `ControlNet` class; not a control-LoRA, which builds its model per run with
  weights of its own making): the control model's twin, a copy of its module tree along the paths that
  hosts/forge_plan.py replaces (the UNet's plan, made on the control model: fused GroupNorm(+SiLU), LayerNorm,
  GEGLU, ResBlock and transformer-block stand-ins), holding those replacements. Every other module, and every
  parameter and buffer table, is the control model's own, so Forge's loading, offloading and weight changes
  are the twin's too, and the control model itself, and the patcher Forge loads it with, are never modified:
  SD Accel off, or a run without the hook, calls it as Forge made it. With CUDA graphs the twin's forward
  replays per shape (engine/graphs/graphed_forward.py), its conv weights in Forge's layout (converting the
  user's control model in place would slow Forge's own runs of it); without, the faster of the fused and
  Forge's modules, measured per shape (engine/graphs/eager.py).
* anything else (a control-LoRA, a T2I adapter, a control model another extension changed, modules Forge casts
  on the fly under low VRAM): exactly the call Forge makes without the hook.
A hook another extension set before SD Accel's is kept (SD Accel's is not set); one set after it replaces it.
"""
import logging
import sys
import weakref

from ..engine.graphs import eager
from ..engine.graphs.graphed_forward import GraphedForward
from ..engine.patches import patch_folding
from . import forge_plan, webui
from .attached import state_on

log = logging.getLogger("sd_accel")
HOOK = "controlnet_model_function_wrapper"
_STATE_ATTR = "_sd_accel_forge_controlnet"
_SEEN = weakref.WeakSet()   # control states, for the status


class _ControlState:
    """Per control model: the plan, the twins made from it, what the last call ran."""

    def __init__(self):
        self.plan = forge_plan.ForgeState()
        self.twins = {}          # (paths replaced, cuda_graph) -> (twin, GraphedForward or None)
        self.eager_paths = eager.EagerPaths()
        self.checked = (None, None)   # (run epoch, (twin, forward) or the reason it runs as Forge made it)
        self.calls = 0
        self.counts = {}         # {op: modules} the last run's twin replaces


def _forge_controlnet_class():
    mod = sys.modules.get("backend.patcher.controlnet")
    return getattr(mod, "ControlNet", None)


def is_ours(fn):
    return getattr(fn, "sd_accel_forge_controlnet", False)


def install(clone, st, options, unet):
    """Sets the hook on `clone` (SD Accel's clone of the UNet patcher, whose UNet is `unet`). Returns None, or
    why not."""
    if not (options.want("fused_kernels") or options.want("cuda_graph")):
        return None
    to = clone.model_options.setdefault("transformer_options", {})
    theirs = to.get(HOOK)
    if theirs is not None and not is_ours(theirs):
        return "another extension's %s is set: ControlNets left to Forge" % HOOK
    to[HOOK] = wrapper_for(st, options, unet)
    return None


def strip(clone):
    to = clone.model_options.get("transformer_options", {})
    if is_ours(to.get(HOOK)):
        del to[HOOK]


def wrapper_for(st, options, unet):
    """The hook for the UNet state `st` and `options`: one function each (part of the UNet's graph key, and
    Forge deep-copies model options: a plain function keeps its identity there). `unet`: the UNet the run's
    ControlNets serve, whose package's module classes count as Forge's in the control model (held weakly)."""
    hooks = st.controlnet_hooks
    fn = hooks.get(options)
    if fn is not None:
        return fn
    unet_ref = weakref.ref(unet)

    def controlnet_model_function_wrapper(model, inner_model, hint, **kw):
        hint = hint.to(model.device)
        if "x" not in kw:   # a T2I adapter: Forge's own call
            return inner_model(hint)
        args = dict(x=kw["x"], hint=hint, timesteps=kw["timesteps"], context=kw["context"], y=kw.get("y"))
        cs = _state(inner_model)
        run = _accelerated(cs, model, inner_model, st, options, unet_ref(), args["x"].device)
        if run is None:
            return inner_model(**args)
        twin, forward = run
        if forward is not None:
            with webui.capturable_timestep_embedding(twin):
                return forward(**args)
        key = ("no graphs", tuple(args["x"].shape), args["x"].dtype)
        return cs.eager_paths.run(key, twin, (), args, args["x"].device)
    controlnet_model_function_wrapper.sd_accel_forge_controlnet = True
    controlnet_model_function_wrapper.sd_accel_inert = ("forge controlnet", options)
    hooks[options] = controlnet_model_function_wrapper
    return controlnet_model_function_wrapper


def _state(control_model):
    return state_on(control_model, _STATE_ATTR, _new_state)


def _new_state():
    cs = _ControlState()
    _SEEN.add(cs)
    return cs


def _accelerated(cs, model, inner_model, st, options, unet, device):
    """(twin, its graphed forward or None) for this call, or None: Forge's own call. Decided once per run."""
    cs.calls += 1
    if cs.checked[0] is not st.epoch or st.epoch is None:
        try:
            run = _decide(cs, model, inner_model, options, unet, device)
        except Exception as e:  # noqa: BLE001 - a control model SD Accel cannot plan must still run, as Forge's
            run = "SD Accel could not plan the control model (%s: %s)" % (type(e).__name__, str(e)[:160])
        cs.checked = (st.epoch, run)
        if isinstance(run, str):
            log.info("[SD Accel] Forge ControlNet left to Forge: %s", run)
        for twin, forward in cs.twins.values():
            if forward is not None:
                forward.new_run()
                forward.graphs.clear_if_offloaded()
    run = cs.checked[1]
    return None if isinstance(run, str) else run


def _decide(cs, model, inner_model, options, unet, device):
    if type(model) is not _forge_controlnet_class():
        return "%s is not a full ControlNet" % type(model).__name__
    if getattr(model, "control_model", None) is not inner_model:
        return "the control model called is not the ControlNet's own"
    patches = {}
    if options.want("fused_kernels"):
        if not forge_plan.plan_for(cs.plan, inner_model, classes_of=unet):
            return "the control model already holds replacements SD Accel did not plan"
        patcher = getattr(model, "control_model_wrapped", None)
        if patcher is None:
            return "the ControlNet has no model patcher"
        patches, skipped = forge_plan.run_patches(cs.plan, patcher, inner_model, True, False)
        if skipped:
            return "modules left to Forge (%s)" % ", ".join("%s: %d" % (why, len(p)) for why, p in skipped.items())
    cs.counts = webui.replacement_counts(patches)
    graphs = options.want("cuda_graph") and device.type == "cuda"
    key = (frozenset(patches), bool(graphs))
    run = cs.twins.get(key)
    if run is None:
        twin = make_twin(inner_model, patches)
        if twin is None:
            return "a planned path does not run through the control model's modules"
        forward = GraphedForward(twin, "Forge " + type(inner_model).__name__, cuda_graph=True,
                                 channels_last=False) if graphs else None
        run = cs.twins[key] = (twin, forward)
    return run


def make_twin(root, patches):
    """`root` copied on write with `patches` ({path: module}, relative to `root`) in place, as Forge's object patches
    would leave it (engine/patches/patch_folding.py): every module off the patched paths, and every parameter and
    buffer table, is `root`'s own, and `root` is not modified. None where a path does not run through modules."""
    twin = patch_folding.copy_with(root, patches)
    if twin is not None:
        twin.__dict__.pop(_STATE_ATTR, None)
    return twin


def status():
    """JSON-able: per control model seen, its replacements, calls, graph statistics, what its last call ran."""
    out = []
    for cs in list(_SEEN):
        run = cs.checked[1]
        last = run if isinstance(run, str) or run is None else "accelerated"
        entry = {"calls": cs.calls, "last": last, "patched": 0, "counts": {}, "graphs": {}}
        if last == "accelerated":
            forward = run[1]
            entry.update(patched=sum(cs.counts.values()), counts=dict(cs.counts))
            if forward is not None:
                entry["graphs"] = dict(forward.graphs.stats)
        out.append(entry)
    return out
