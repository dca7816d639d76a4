"""Launching a Triton kernel: through its compiled binary, with raw device addresses, once an eager call
with the same signature has compiled it.

Why: Triton's launcher asks the driver about every tensor pointer (cuPointerGetAttribute). Under ComfyUI's
default cudaMallocAsync allocator, memory allocated during a CUDA-graph capture has no address the driver
will confirm until the graph is instantiated, so a plain launch inside a capture fails. An integer address
is passed through unchecked; the address is the one torch's own captured kernels use. It also skips
Triton's per-call argument binding, which is most of a small kernel's launch cost. During such a capture a
kernel must have been compiled by an earlier eager call (CUDA-graph replay always runs the step eagerly
first); otherwise NotWarmedUp is raised before anything is launched for that kernel, and the op falls back.
"""
import threading
import time

import torch

from . import _device


class NotWarmedUp(RuntimeError):
    """A launch during a CUDA-graph capture under cudaMallocAsync found no kernel compiled for its
    arguments by an earlier eager call: the op falls back to its reference for this call."""
    reason = "graph capture before any eager call of this shape"


# First launches of each signature (Triton compiles, or loads from its on-disk cache, in them): how many and
# their host seconds, so a benchmark can tell a cold first run's compilation from its other costs.
# "ahead": kernels compiled in parallel by _compile_ahead.run_compiling_ahead, and the seconds those runs took.
first_launches = {"count": 0, "seconds": 0.0, "ahead": 0, "ahead_seconds": 0.0}


class _ColdLaunch(threading.local):
    """What a launch on this thread does first when its kernel has no compiled binary: `submit_ahead`, set by
    _compile_ahead while a pass compiles ahead, hands the compilation to a pool (and raises CompilingAhead)."""
    submit_ahead = None


cold_launch = _ColdLaunch()

_compiled = {}        # (jit kernel, device index, argument signature) -> triton CompiledKernel
_MAX_COMPILED = 4096  # distinct shapes seen; far above a UNet's (a few hundred per resolution)


def _signature(args, meta):
    """What Triton specialises a compiled kernel on, stricter: tensors by dtype and 16-byte alignment,
    every scalar by value, every meta-parameter by value."""
    sig = []
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append((a.dtype, a.data_ptr() % 16 == 0))
        else:
            sig.append(a)
    return tuple(sig), tuple(sorted(meta.items()))


def _bound_args(kernel, args, meta):
    """The kernel's arguments in declaration order, as Triton's launcher takes them (constexprs
    included; it skips them), with tensors as raw addresses. None if the call does not name every
    parameter (the cached path is then not used for this kernel)."""
    names = kernel.arg_names
    if len(args) > len(names) or any(n not in meta for n in names[len(args):]):
        return None
    vals = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
    return vals + [meta[n] for n in names[len(args):]]


def _compiled_launch_applies(t):
    return t.device.type == "cuda"


def _kernel_name(kernel):
    return getattr(kernel, "__name__", str(kernel))


def _first_launch(kernel, grid, args, meta, key):
    """Launch a kernel with no cached binary for `key`: compile (or load) it through Triton's JIT, and keep
    the binary when the call names every parameter."""
    if torch.cuda.is_current_stream_capturing() and _device.async_allocator():
        raise NotWarmedUp(_kernel_name(kernel))
    if cold_launch.submit_ahead is not None:
        cold_launch.submit_ahead(kernel, grid, args, meta)
    t0 = time.perf_counter()
    compiled = kernel[grid](*args, **meta)
    first_launches["count"] += 1
    first_launches["seconds"] += time.perf_counter() - t0
    if _bound_args(kernel, args, meta) is not None and hasattr(compiled, "__getitem__"):
        if len(_compiled) >= _MAX_COMPILED:
            _compiled.clear()
        _compiled[key] = compiled


def launch(kernel, grid, *args, **meta):
    """`kernel[grid](*args, **meta)`, through the compiled kernel with raw device addresses once an eager
    call with the same signature has compiled it (see the module's docstring for why)."""
    t = next(a for a in args if isinstance(a, torch.Tensor))
    if not _compiled_launch_applies(t):   # the interpreter (CI): plain launch
        kernel[grid](*args, **meta)
        return
    key = (kernel, t.device.index, _signature(args, meta))
    compiled = _compiled.get(key)
    if compiled is None:
        _first_launch(kernel, grid, args, meta, key)
        return
    # CompiledKernel's runner reads grid[0], grid[1] and grid[2] (the JIT path pads the grid itself)
    compiled[tuple(grid) + (1,) * (3 - len(grid))](*_bound_args(kernel, args, meta))
