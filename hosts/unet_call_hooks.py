"""Hooks around a WebUI UNet's own calls, for the calls SD Accel's step does not run.

Such a call (CUDA graphs off, another "SD Unet", an extension that set the UNet's `forward` or replaced SD Accel's
wrapper) would otherwise run whatever modules are in place: the fused ones, whose launches cost host time without
graphs. The host's `choose` gives it its path instead: the faster of the fused and the stock modules, measured per
shape (engine/graphs/eager.py), or None to leave the call alone.
"""


class CallHooks:
    """The hook handles, and per call in progress its path's scope (None: left alone). `missing` says why there
    are no hooks."""

    def __init__(self):
        self.handles = ()
        self.scopes = []
        self.missing = None

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = ()
        self.scopes.clear()


def hook_calls(unet, choose):
    """Hooks `unet`'s calls. `choose(unet, x)` returns the context manager the call runs in, or None. The hooks
    hold `choose` and the returned CallHooks, so neither may hold the model (a module-level function, or a weak
    reference to the host's state)."""
    hooks = CallHooks()

    def enter(module, args, kwargs):
        x = args[0] if args else kwargs.get("x")
        scope = choose(module, x)
        if scope is not None:
            scope.__enter__()
        hooks.scopes.append(scope)
        return None

    def leave(module, args, output):
        scope = hooks.scopes.pop() if hooks.scopes else None
        if scope is not None:
            scope.__exit__(None, None, None)
        return None

    pre = None
    try:
        pre = unet.register_forward_pre_hook(enter, with_kwargs=True)
        hooks.handles = (pre, unet.register_forward_hook(leave, always_call=True))
    except TypeError as e:   # a torch without keyword or always-called hooks
        if pre is not None:
            pre.remove()
        hooks.missing = "this torch cannot hook the UNet's calls (%s)" % e
    return hooks
