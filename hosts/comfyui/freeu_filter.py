"""ComfyUI's FreeU and FreeU_V2 patches filter the skip features through SD Accel's kernel on accelerated runs.

Their output_block_patch closures call `Fourier_filter` (comfy_extras/nodes_freelunch.py), a dozen full passes
over complex fp32 copies per skip: most of what FreeU_V2 adds to an accelerated SDXL step. On an accelerated
call (fused kernels on) each such closure in the call's transformer_options is swapped for a copy that shares
its code, its closure cells (b1, b2, s1, s2) and its module's globals but for one name, `Fourier_filter`, which
runs kernels/fourier_low_scale.py where it can take the tensor, and the stock function otherwise. The same
closure always gets the same copy (a graph key sees the same patch on every call), and the copy lives as long
as the closure does. Nothing global changes: stock KSampler, and every other caller, runs the stock filter.

Only the node's own code is swapped: a closure is recognised by its code object, one of those nested in the
FreeU classes of the running ComfyUI, and its `Fourier_filter` must be that module's own function, checked on
every call (another pack that replaced it, before the first run or since, keeps its replacement).
"""
import logging
import types
import weakref

from ...engine.reports import kernel_report
from ...kernels.errors import first_line
from ...kernels.fourier_low_scale import eligible, fourier_low_scale

log = logging.getLogger("sd_accel")
OP = "freeu_filter"   # the report's name: what the user put in the graph
_FILTER = "Fourier_filter"
_WRAPPED = "_sd_accel_wrapped_filter"   # in a copy's globals: the module's filter it was made over
_MODULE = "comfy_extras.nodes_freelunch"
_copies = weakref.WeakKeyDictionary()   # a FreeU closure -> its copy on SD Accel's filter
_codes = None                            # the FreeU closures' code objects in this ComfyUI
_failed = []


def _freeu_codes():
    global _codes
    if _codes is None:
        codes = set()
        try:
            import comfy_extras.nodes_freelunch as freelunch
        except Exception:  # noqa: BLE001 - a ComfyUI without the FreeU nodes: nothing to recognise
            freelunch = None
        for cls_name in ("FreeU", "FreeU_V2"):
            for attr in vars(getattr(freelunch, cls_name, object)).values():
                fn = getattr(attr, "__func__", attr)
                for const in getattr(getattr(fn, "__code__", None), "co_consts", ()):
                    if isinstance(const, types.CodeType) and const.co_name == "output_block_patch":
                        codes.add(const)
        _codes = frozenset(codes)
    return _codes


def _is_stock_filter(fn):
    return isinstance(fn, types.FunctionType) and fn.__module__ == _MODULE and fn.__qualname__ == _FILTER


def _filter_through_kernel(stock):
    def fourier_filter(x, threshold, scale):
        if _failed or not eligible(x, threshold, scale)[0]:
            return stock(x, threshold=threshold, scale=scale)
        try:
            y = fourier_low_scale(x, threshold, scale)
        except Exception as e:  # noqa: BLE001 - FreeU's own `except:` would move every later filter to the CPU
            _failed.append(e)
            log.warning("[SD Accel] FreeU's filter kernel failed (%s); the stock filter runs from now on",
                        first_line(e))
            return stock(x, threshold=threshold, scale=scale)
        kernel_report.record(OP, fourier_low_scale.last_call)
        return y
    return fourier_filter


def fast_copy(patch):
    """The copy of `patch` on SD Accel's filter, or None when `patch` is not a FreeU node's closure."""
    if not isinstance(patch, types.FunctionType) or patch.__code__ not in _freeu_codes():
        return None
    stock = patch.__globals__.get(_FILTER)
    copy = _copies.get(patch)
    if copy is not None and copy.__globals__[_WRAPPED] is stock:
        return copy
    if not _is_stock_filter(stock):   # another pack's filter, set before the first run or since
        _copies.pop(patch, None)
        return None
    names = dict(patch.__globals__)
    names[_FILTER], names[_WRAPPED] = _filter_through_kernel(stock), stock
    copy = types.FunctionType(patch.__code__, names, patch.__name__, patch.__defaults__, patch.__closure__)
    copy.__qualname__ = patch.__qualname__
    copy.__kwdefaults__ = patch.__kwdefaults__
    _copies[patch] = copy
    return copy


def _swapped(transformer_options):
    """`transformer_options`, or a copy whose output_block_patch list has the FreeU closures' copies."""
    patches = transformer_options.get("patches") if isinstance(transformer_options, dict) else None
    listed = patches.get("output_block_patch") if isinstance(patches, dict) else None
    if not listed:
        return transformer_options
    swapped = [fast_copy(p) or p for p in listed]
    if all(a is b for a, b in zip(swapped, listed)):
        return transformer_options
    out = dict(transformer_options)
    out["patches"] = dict(patches, output_block_patch=swapped)
    return out


def on_fast_filter(args, kwargs, transformer_options):
    """(args, kwargs, transformer_options) of one UNet call with the FreeU closures in its transformer_options
    swapped for their copies (the objects themselves when there are none)."""
    swapped = _swapped(transformer_options)
    if swapped is transformer_options:
        return args, kwargs, transformer_options
    args = tuple(swapped if a is transformer_options else a for a in args)
    kwargs = {k: swapped if v is transformer_options else v for k, v in kwargs.items()}
    return args, kwargs, swapped
