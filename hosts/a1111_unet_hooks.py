"""Another extension's hook inside A1111's UNet forward, whose decisions a CUDA graph would bake in.

ldm's and sgm's UNet forward concatenate every skip connection through `th.cat`, `th` being A1111's torch proxy
(modules/sd_hijack_unet.py, set on both openaimodel modules). sd-webui-freeu sets a `cat` of its own on that
proxy: on every call it decides in Python, from its settings and the sampling step (its start/stop schedule),
whether and how to scale the backbone and filter the skip. A graph captured at one step would replay that
decision at every later one, and after the user changed or switched off FreeU: a wrong image. So while such a
hook is in place the UNet's calls run eagerly (the measured faster path), the report saying why; except while
sd-webui-freeu itself is switched off, which its hook checks first before calling torch's cat unchanged: graphs
run then, and the next call after it is switched on runs eagerly again.
"""
import sys

import torch

_A1111_PROXY = "modules.sd_hijack_unet"
_FREEU = "lib_free_u"      # sd-webui-freeu's package


def _name(fn):
    fn = getattr(fn, "func", fn)   # functools.partial, as sd-webui-freeu installs it
    return "%s from %s" % (getattr(fn, "__qualname__", type(fn).__name__), getattr(fn, "__module__", "?"))


def _freeu_switched_off(hook):
    """sd-webui-freeu's hook, with its own switch off (`global_state.instance.enable`, `global_state.enabled` in
    its older releases): it then calls torch's cat and nothing else."""
    if not getattr(getattr(hook, "func", hook), "__module__", "").startswith(_FREEU + "."):
        return False
    state = sys.modules.get(_FREEU + ".global_state")
    instance = getattr(state, "instance", None)
    switch = getattr(instance, "enable", None) if instance is not None else getattr(state, "enabled", None)
    return switch is False


def reason(unet):
    """Why no graph may run this call of `unet`, or None."""
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
