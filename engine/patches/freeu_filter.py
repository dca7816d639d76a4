"""FreeU's patches filter the skip features through SD Accel's kernel on accelerated runs (ComfyUI's FreeU and
FreeU_V2 nodes, Forge's built-in FreeU: the same patch mechanism in both hosts' transformer_options).

Their output_block_patch closures call `Fourier_filter` (comfy_extras/nodes_freelunch.py), a dozen full passes
over complex fp32 copies per skip: most of what FreeU_V2 adds to an accelerated SDXL step. On an accelerated
call (fused kernels on) each such closure in the call's transformer_options is swapped for a copy that shares
its code, its closure cells (b1, b2, s1, s2) and its module's globals but for one name, `Fourier_filter`, which
runs kernels/fourier_low_scale.py where it can take the tensor, and the stock function otherwise. The same
closure always gets the same copy (a graph key sees the same patch on every call), and the copy lives as long
as the closure does. Nothing global changes: stock KSampler, and every other caller, runs the stock filter.

Only a FreeU filter of the patch's own is swapped: an output_block_patch function whose code calls the global
`Fourier_filter`, that global being ComfyUI's own (comfy_extras/nodes_freelunch.py), or a function of the patch's
own module that computes the same filter (Forge's built-in FreeU carries its own copy), told once by running it
on small CPU tensors against SD Accel's reference. Checked on every call: another pack that replaced the filter,
before the first run or since, keeps its replacement.
"""
import logging
import types
import weakref

import torch

from ...kernels._dispatch import REFERENCE, Outcome
from ...kernels.errors import first_line
from ...kernels.fourier_low_scale import eligible, fourier_low_scale, fourier_low_scale_reference
from ..reports import kernel_report

log = logging.getLogger("sd_accel")
OP = "freeu_filter"   # the report's name: what the user put in the graph
_FILTER = "Fourier_filter"
_WRAPPED = "_sd_accel_wrapped_filter"   # in a copy's globals: the module's filter it was made over
_MODULE = "comfy_extras.nodes_freelunch"
_copies = weakref.WeakKeyDictionary()   # a FreeU closure -> its copy on SD Accel's filter
_behaves = weakref.WeakKeyDictionary()  # a module's own filter function -> whether it computes FreeU's filter
_failed = []   # the kernel's failure, as its message: an exception kept would keep its traceback's frames, and the
               # whole call stack above them (the run's clone, its patches, its inputs), alive for good
# (shape, scale) of the CPU tensors a module's own filter is checked on: even and odd sides, two scales
_CHECKS = (((1, 3, 8, 8), 0.9), ((2, 2, 7, 9), 0.2), ((1, 2, 6, 5), 1.4))


def _is_stock_filter(fn):
    return isinstance(fn, types.FunctionType) and fn.__module__ == _MODULE and fn.__qualname__ == _FILTER


def _is_freeu_filter(fn, patch):
    """`fn` (the patch's global `Fourier_filter`) computes FreeU's filter: ComfyUI's own, or a function of the
    patch's own module that gives the reference's result on the check tensors (once per function)."""
    if _is_stock_filter(fn):
        return True
    if not isinstance(fn, types.FunctionType) or fn.__globals__ is not patch.__globals__:
        return False
    known = _behaves.get(fn)
    if known is None:
        known = _behaves[fn] = _computes_the_filter(fn)
    return known


def _computes_the_filter(fn):
    gen = torch.Generator().manual_seed(0)
    try:
        with torch.inference_mode():
            for shape, scale in _CHECKS:
                x = torch.randn(shape, generator=gen)
                got = fn(x, threshold=1, scale=scale)
                want = fourier_low_scale_reference(x, 1, scale)
                if not (isinstance(got, torch.Tensor) and got.shape == want.shape and
                        torch.allclose(got.float(), want, rtol=1e-4, atol=1e-5)):
                    return False
    except Exception:  # noqa: BLE001 - a filter that cannot run here is not the one SD Accel's kernel computes
        return False
    return True


def _filter_through_kernel(stock):
    def fourier_filter(x, threshold, scale):
        ok, why = (False, "the kernel failed earlier in this process") if _failed else eligible(x, threshold, scale)
        if not ok:      # the host's own filter, counted in the report with the reason
            kernel_report.record(OP, Outcome(REFERENCE, why))
            return stock(x, threshold=threshold, scale=scale)
        try:
            y = fourier_low_scale(x, threshold, scale)
        except Exception as e:  # noqa: BLE001 - FreeU's own `except:` would move every later filter to the CPU
            _failed.append(first_line(e))
            log.warning("[SD Accel] FreeU's filter kernel failed (%s); the stock filter runs from now on",
                        first_line(e))
            kernel_report.record(OP, Outcome(REFERENCE, "the kernel failed: %s" % first_line(e)))
            return stock(x, threshold=threshold, scale=scale)
        kernel_report.record(OP, fourier_low_scale.last_call)
        return y
    return fourier_filter


def fast_copy(patch):
    """The copy of `patch` on SD Accel's filter, or None when `patch` does not call a FreeU filter of its own."""
    if not isinstance(patch, types.FunctionType) or _FILTER not in patch.__code__.co_names:
        return None
    stock = patch.__globals__.get(_FILTER)
    copy = _copies.get(patch)
    if copy is not None and copy.__globals__[_WRAPPED] is stock:
        names = copy.__globals__
        ours = names[_FILTER]
        names.update(patch.__globals__)     # the module's names as they are now (a flag it rebinds, say)
        names[_FILTER], names[_WRAPPED] = ours, stock
        return copy
    if not _is_freeu_filter(stock, patch):   # another pack's filter, set before the first run or since
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
