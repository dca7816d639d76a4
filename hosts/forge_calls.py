"""Forge host: the UNet's calls that do not come through SD Accel's step.

Forge has one `model_function_wrapper` slot and runs the extensions' `process_before_every_sampling` in load
order. A wrapper set before SD Accel's is chained (SD Accel's step runs inside it); one an extension loaded
after SD Accel sets replaces SD Accel's step, and Forge then calls the UNet with SD Accel's object patches in but
without its step. Hooks around the UNet's calls give such a call what the step gives a call it does not replay:
the faster of the fused and Forge's own modules, measured per shape (engine/graphs/eager.py), on Forge's conv
layout (channels_last weights, kept for graphs, go back at the first such call: eager kernels run faster on
Forge's layout). A call while SD Accel's modules are not in the UNet (SD Accel off: Forge loaded a patcher
without them) is left alone.
"""
import weakref

from ..engine.graphs import eager
from ..engine.thread_scope import ThreadScope
from ..engine.patches import patching
from . import unet_call_hooks

IN_STEP = ThreadScope()   # SD Accel's step is running on this thread (its calls choose their own path)


def bracket(unet, st, layout_back):
    """Hooks `unet`'s calls once per model (hosts/unet_call_hooks.py). `layout_back(st, unet, why)`: the conv
    weights back in Forge's layout (a module-level function: the hooks hold nothing that holds the model)."""
    if st.call_hooks is not None:
        return
    ref = weakref.ref(st)    # the hooks live on the UNet, the state on its KModel: no cycle through them

    def choose(module, x):
        s = ref()
        if s is None or IN_STEP.local.depth or not ours_in_place(module, s):
            return None
        if s.channels_last:
            layout_back(s, module, "a UNet call outside SD Accel's step (another extension's wrapper replaced it): "
                        "%d conv weights back in Forge's layout")
        if s.eager_paths is None:
            s.eager_paths = eager.EagerPaths()
        s.outside_calls += 1
        return s.eager_paths.path_for(("outside SD Accel's step", tuple(x.shape), x.dtype), x.device)

    st.call_hooks = unet_call_hooks.hook_calls(unet, choose)


def ours_in_place(unet, st):
    """SD Accel's last run's modules are in `unet` (Forge put its clone's object patches in)."""
    for path, module in (st.patches or {}).items():
        try:
            return patching.get_attr(unet, path) is module
        except AttributeError:
            return False
    return False


def status(st):
    out = {"calls": st.outside_calls,
           "paths": st.eager_paths.choices() if st.eager_paths is not None and st.outside_calls else {}}
    if st.call_hooks is not None and st.call_hooks.missing:
        out["not_hooked"] = st.call_hooks.missing
    return out
