"""Another pack's model_function_wrapper that runs the UNet's blocks itself instead of calling apply_model (the
DeepCache packs for ComfyUI: styler00dollar/ComfyUI-deepcache and its forks skip the deep blocks on cached steps
by running the input, middle and output blocks in their own loop).

SD Accel's step (its graphs, and the choice of the faster eager path: engine/graphs/eager.py) sits on apply_model,
so such a wrapper would call SD Accel's stand-ins eagerly on their fused path, which is slower than the host's own
modules where the host is the bound. Guarded, the wrapper runs with the host's own modules (stock's numbers, each
stand-in adding only the few Python calls of its stock branch); whatever it passes through the model function it
was given reaches SD Accel's step as before. A call of the wrapper that never reached apply_model is counted with
one line saying so.
"""
import functools

from ...engine.patches import stock_path

REASON = ("another pack's model_function_wrapper (%s) ran the UNet's blocks itself, without apply_model: the "
          "host's own modules ran there")
_GUARDED = "sd_accel_guarded"


class _ThroughStep:
    """The model function handed to the foreign wrapper: the host's own (its attributes read through, for a wrapper
    that looks at `model_function.__self__`), called outside the stock scope, so SD Accel's step decides."""

    def __init__(self, fn, reached):
        self._fn, self._reached = fn, reached

    def __call__(self, *args, **kwargs):
        self._reached.append(True)
        with stock_path.fused_modules():
            return self._fn(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._fn, name)


def name_of(fn):
    fn = getattr(fn, "func", fn)    # a functools.partial
    return "%s.%s" % (getattr(fn, "__module__", "?"), getattr(fn, "__qualname__", type(fn).__name__))


def guarded(foreign, refused):
    """`foreign` (a model_function_wrapper) run as the module doc says; `refused`: a Counter of reasons (the step
    graphs' `refused`, which the run report reads)."""
    if getattr(foreign, _GUARDED, None) is not None:
        return foreign
    reason = REASON % name_of(foreign)

    @functools.wraps(foreign)
    def wrapper(model_function, params):
        reached = []
        with stock_path.stock_modules():
            out = foreign(_ThroughStep(model_function, reached), params)
        if not reached:
            refused[reason] += 1
        return out
    setattr(wrapper, _GUARDED, foreign)
    return wrapper


def guard_run(model_options, refused):
    """Current ComfyUI, at the start of a sampling run (our OUTER_SAMPLE wrapper): guards the run's
    model_function_wrapper when another pack set it (`model_options` is the run's own copy)."""
    foreign = (model_options or {}).get("model_function_wrapper")
    if foreign is not None and getattr(foreign, "sd_accel_step", None) is None:
        model_options["model_function_wrapper"] = guarded(foreign, refused)
