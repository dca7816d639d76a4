"""Another extension's hook inside the WebUIs' UNet forward, whose decisions a CUDA graph would bake in.

While one is in place the graph route's calls (A1111's "SD Unet" route, Forge's step) run eagerly (the measured
faster path), the report saying why.

* Modules of its own among the UNet's blocks: Kohya Hires.fix (sd-webui-kohya-hiresfix) wraps an input and an
  output block in a module that rescales the features, from a callback before each step, and takes it out after
  its last scaled step, or changes its scale on every step ("smooth scaling"). A block swapped in the middle of a
  run keeps every weight where it was, so the weights' fingerprint (read in full once per run) does not see it,
  nor a number changed on a module: a graph would replay the first step's scale, and after the wrapper is gone.
  Every call reads the types of the UNet's input, middle and output blocks (a few dozen).
* A forward of its own set on a module inside the UNet: Regional Prompter sets one on every cross-attention
  (`module.forward = ...`) before a generation, which counts its calls and switches between the positive and the
  negative prompt's regions every so many: Python state outside the call that a replay would neither read nor
  advance. A1111's own HyperTile wraps self-attentions the same way (a random tile split per call, its size from
  the image): switched off, its wrapper calls the layer's forward unchanged and graphs run. Read once per sampling
  run (SD Accel's own forward patches carry `sdaccel_kind`).
* A hook on the skip concatenation: ldm's and sgm's UNet forward concatenate every skip connection through
  `th.cat`, `th` being A1111's torch proxy (modules/sd_hijack_unet.py, set on both openaimodel modules).
  sd-webui-freeu sets a `cat` of its own on that proxy, which decides on every call, from its settings and the
  sampling step (its start/stop schedule), whether and how to scale the backbone and filter the skip: a graph
  would replay one step's decision at every other, and after the user changed or switched off FreeU. While
  sd-webui-freeu itself is switched off (its hook checks that first, then calls the proxy's cat unchanged), graphs
  run; the first call after it is switched on runs eagerly again.
"""
import sys

import torch

_A1111_PROXY = "modules.sd_hijack_unet"
_FREEU = "lib_free_u"      # sd-webui-freeu's package
# where the blocks of A1111's and Forge's UNets, and SD Accel's own modules, come from
_OWN_BLOCKS = ("ldm.", "sgm.", "backend.", "ldm_patched.", "torch.", __name__.rsplit(".hosts.", 1)[0] + ".")


def _defined_in(fn):
    """The module `fn` was written in: a function's globals (functools.wraps copies the wrapped one's `__module__`
    onto a wrapper: HyperTile's), else its `__module__`."""
    fn = getattr(fn, "__func__", fn)
    names = getattr(fn, "__globals__", None)
    return names.get("__name__", "?") if isinstance(names, dict) else (getattr(fn, "__module__", None) or "?")


def _name(fn):
    fn = getattr(fn, "func", fn)   # functools.partial, as sd-webui-freeu installs it
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    name = getattr(code, "co_qualname", None) or getattr(fn, "__qualname__", None) or type(fn).__name__
    return "%s from %s" % (name, _defined_in(fn))


def _freeu_switched_off(hook):
    """sd-webui-freeu's hook, with its own switch off (`global_state.instance.enable`, `global_state.enabled` in
    its older releases): it then calls torch's cat and nothing else."""
    if not _defined_in(getattr(hook, "func", hook)).startswith(_FREEU + "."):
        return False
    state = sys.modules.get(_FREEU + ".global_state")
    instance = getattr(state, "instance", None)
    switch = getattr(instance, "enable", None) if instance is not None else getattr(state, "enabled", None)
    return switch is False


def _foreign_block(unet):
    """Where another extension's module stands among the UNet's blocks, or None."""
    lists = (("input_blocks", getattr(unet, "input_blocks", None) or ()),
             ("middle_block", [getattr(unet, "middle_block", None)]),
             ("output_blocks", getattr(unet, "output_blocks", None) or ()))
    for name, blocks in lists:
        for i, block in enumerate(blocks):
            if block is not None and not type(block).__module__.startswith(_OWN_BLOCKS):
                return "%s[%d] (%s from %s)" % (name, i, type(block).__qualname__, type(block).__module__)
    return None


def _ours(forward):
    return getattr(forward, "sdaccel_kind", None) is not None or _defined_in(forward).startswith(_OWN_BLOCKS[-1])


def _switched_off_hypertile(module, forward):
    """A1111's built-in HyperTile once enabled leaves its wrapper on every self-attention it tiles for good, and
    switches it per generation (`params.enabled`, set before sampling): switched off, it calls the layer's own
    forward and nothing else."""
    params = module.__dict__.get("__webui_hypertile_params")
    return _defined_in(forward) == "hypertile" and getattr(params, "enabled", None) is False


def foreign_forward(unet):
    """Where another extension set a module's own `forward` inside the UNet, as a reason, or None."""
    for name, module in unet.named_modules():
        forward = module.__dict__.get("forward") if name else None
        if forward is not None and not _ours(forward) and not _switched_off_hypertile(module, forward):
            return ("another extension set the forward of %s (%s): it may keep state between calls that a graph "
                    "would not advance" % (name, _name(forward)))
    return None


def foreign_forward_in_run(unet, st):
    """`foreign_forward`, read once per sampling run (`st.epoch`; every call without one): extensions set their
    forwards before a run. The result is kept in `st.forwards`."""
    if st.forwards is None or st.forwards[0] is not st.epoch or st.epoch is None:
        st.forwards = (st.epoch, foreign_forward(unet))
    return st.forwards[1]


def refusal(unet, st):
    """Why no graph may run this call of `unet` (the host's per-model state `st` keeps the once-a-run read), or
    None: what both WebUIs' graph routes ask before each call."""
    return reason(unet) or foreign_forward_in_run(unet, st)


def reason(unet):
    """Why no graph may run this call of `unet` for a hook read on every call, or None."""
    where = _foreign_block(unet)
    if where:
        return ("another extension's module among the UNet's blocks, at %s: it may change from step to step, where "
                "a graph would replay the first" % where)
    th = getattr(sys.modules.get(type(unet).__module__), "th", torch)
    if th is torch:
        return None
    proxy = getattr(sys.modules.get(_A1111_PROXY), "th", None)
    if th is not proxy:
        return "another extension replaced the torch the UNet's forward calls (%s)" % type(th).__qualname__
    hook = vars(th).get("cat")
    if hook is None or _freeu_switched_off(hook):
        return None
    return ("another extension hooks the UNet's skip concatenation (%s): it decides on every call, by its settings "
            "and the step, what a graph would replay unchanged" % _name(hook))
