"""Lazy, guarded Triton import and the "can a Triton kernel run on this tensor?" check.

Triton is optional: nothing here raises at import time. Op files call `get_triton()` once at their own
import and define their @triton.jit kernels only when it returns a module pair, so importing an op on a
machine without Triton still works and every call falls back to the op's plain-torch reference.

`TRITON_INTERPRET=1` (Triton's CPU interpreter, read by Triton when it is first imported) is how CI
checks kernels without a GPU; only then are CPU tensors accepted.
"""
import logging
import os
import threading
import time

import torch

log = logging.getLogger("sd_accel")
MIN_CAPABILITY = (7, 0)  # Triton's oldest supported NVIDIA target (Volta)

_triton_pair = None  # (triton, triton.language) once imported, False when the import failed
_capability = {}     # device index -> (major, minor); cached so eligibility checks cost no driver calls


def get_triton():
    """(triton, triton.language), or None when Triton is missing or broken. Never raises."""
    global _triton_pair
    if _triton_pair is None:
        try:
            import triton
            import triton.language as tl
            _triton_pair = (triton, tl)
        except Exception:  # ImportError, or a broken install raising anything at import
            _triton_pair = False
    return _triton_pair or None


def interpret_mode():
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def _device_capability(device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capability:
        _capability[index] = torch.cuda.get_device_capability(index)
    return _capability[index]


_async_alloc = None


def async_allocator():
    """True when PyTorch's CUDA allocator is cudaMallocAsync (ComfyUI's default on NVIDIA)."""
    global _async_alloc
    if _async_alloc is None:
        try:
            _async_alloc = torch.cuda.get_allocator_backend() == "cudaMallocAsync"
        except Exception:  # noqa: BLE001 - old torch or no CUDA: the native allocator
            _async_alloc = False
    return _async_alloc


def triton_runnable(t):
    """(True, "") when a Triton kernel can run on tensor `t`'s device, else (False, short reason)."""
    if get_triton() is None:
        return False, "no Triton"
    if t.device.type == "cuda":
        major, minor = _device_capability(t.device)
        if (major, minor) < MIN_CAPABILITY:
            return False, f"GPU sm_{major}{minor} < sm_{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]}"
        # (a capture under cudaMallocAsync is handled by `launch`: see there)
        return True, ""
    if t.device.type == "cpu":
        if interpret_mode():
            return True, ""
        return False, "CPU tensor"
    return False, f"{t.device.type} tensor"


def is_channels_last(t):
    """4-D and stored channels_last but not also NCHW-contiguous (a tensor can be both when C == 1 or
    H * W == 1; NCHW addressing is then right for it too)."""
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def activation_ineligible(x, dtypes):
    """Why the per-channel kernels (group_norm_silu, bias_residual_add) cannot take activation `x` of shape
    [N, C, ...] (3-D or 4-D, NCHW-contiguous or channels_last), or None when they can."""
    ok, why = triton_runnable(x)
    if not ok:
        return why
    if x.dtype not in dtypes:
        return f"dtype {x.dtype}"
    if x.dim() not in (3, 4):
        return f"{x.dim()}-D input"
    if not (x.is_contiguous() or is_channels_last(x)):
        return "layout neither contiguous nor channels_last"
    if x.numel() == 0:
        return "empty input"
    if x.numel() >= 2**31:
        return "too large for int32 offsets"
    if x.shape[0] > 65535:
        return "batch > 65535 (grid limit)"
    return None


def per_channel_ineligible(x, **params):
    """Why a per-channel parameter (weight, bias: None or a contiguous float [C] tensor on x's device) does
    not fit activation `x`, or None."""
    C = x.shape[1]
    for name, p in params.items():
        if p is None:
            continue
        if p.device != x.device or not p.is_floating_point() or p.shape != (C,) or p.stride() != (1,):
            return f"{name} not a contiguous float [C] tensor on x's device"
    return None


def num_warps_for(tile_elems):
    """Warps for a memory-bound tile: about 16-32 elements per thread keeps enough loads in flight."""
    if tile_elems <= 2048:
        return 4
    if tile_elems <= 8192:
        return 8
    return 16


def cdiv(a, b):
    return -(-a // b)


def next_pow2(n):
    return 1 << max(0, int(n) - 1).bit_length()


def record(fn, path, reason=""):
    """Note on the public op `fn` which path ran, so tests can tell the kernel from the fallback."""
    fn.last_path = path
    fn.last_reason = reason
    fn.calls[path] = fn.calls.get(path, 0) + 1


def init_record(fn):
    """Give a public op its `last_path` / `last_reason` / `calls` attributes before its first call."""
    fn.last_path = None
    fn.last_reason = ""
    fn.calls = {"triton": 0, "reference": 0}
    return fn


class NotWarmedUp(RuntimeError):
    """A launch during a CUDA-graph capture under cudaMallocAsync found no kernel compiled for its
    arguments by an earlier eager call: the op falls back to its reference for this call."""
    reason = "graph capture before any eager call of this shape"


# First launches of each signature (Triton compiles, or loads from its on-disk cache, in them): how many and
# their host seconds, so a benchmark can tell a cold first run's compilation from its other costs.
# "ahead": kernels compiled in parallel by run_compiling_ahead, and the seconds those runs took.
first_launches = {"count": 0, "seconds": 0.0, "ahead": 0, "ahead_seconds": 0.0}

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


def launch(kernel, grid, *args, **meta):
    """`kernel[grid](*args, **meta)`, through the compiled kernel with raw device addresses once an
    eager call with the same signature has compiled it.

    Why: Triton's launcher asks the driver about every tensor pointer (cuPointerGetAttribute). Under
    ComfyUI's default cudaMallocAsync allocator, memory allocated during a CUDA-graph capture has no
    address the driver will confirm until the graph is instantiated, so a plain launch inside a
    capture fails (seen on an H200, triton 3.6). An integer address is passed through unchecked; the
    address is the one torch's own captured kernels use. It also skips Triton's per-call argument
    binding, which is most of a small kernel's launch cost. During such a capture a kernel must have
    been compiled by an earlier eager call (CUDA-graph replay always runs the step eagerly first);
    otherwise NotWarmedUp is raised before anything is launched for that kernel."""
    t = next(a for a in args if isinstance(a, torch.Tensor))
    if not _compiled_launch_applies(t):   # the interpreter (CI): plain launch
        kernel[grid](*args, **meta)
        return
    key = (kernel, t.device.index, _signature(args, meta))
    compiled = _compiled.get(key)
    if compiled is None:
        if torch.cuda.is_current_stream_capturing() and async_allocator():
            raise NotWarmedUp(getattr(kernel, "__name__", str(kernel)))
        ahead = getattr(_ahead, "state", None)
        if ahead is not None and _submit_ahead(ahead, kernel, grid, args, meta):
            raise CompilingAhead(getattr(kernel, "__name__", str(kernel)))
        t0 = time.perf_counter()
        compiled = kernel[grid](*args, **meta)
        first_launches["count"] += 1
        first_launches["seconds"] += time.perf_counter() - t0
        if _bound_args(kernel, args, meta) is not None and hasattr(compiled, "__getitem__"):
            if len(_compiled) >= _MAX_COMPILED:
                _compiled.clear()
            _compiled[key] = compiled
        return
    # CompiledKernel's runner reads grid[0], grid[1] and grid[2] (the JIT path pads the grid itself)
    compiled[tuple(grid) + (1,) * (3 - len(grid))](*_bound_args(kernel, args, meta))


# ---- Compiling ahead, in parallel ---------------------------------------------------------------------------
# On a cold Triton cache (a user's first run, or any run after a Triton or driver upgrade) the first UNet step
# compiles each of its kernels one after the other as it reaches them: 58 compilations, 20.5 s, for SD1.5 at
# 768² on the H200 machine (device run 44), where a warm first run costs ~0.3 s more than a later one. Triton
# releases the GIL for part of its work (its MLIR/LLVM passes, ptxas in a subprocess), and it can hand its
# compilations to an executor (`triton.runtime._async_compile.AsyncCompileMode`, Triton >= 3.4): on 16 cores,
# 605 kernels in 76 s (run 45: 0.13 s a kernel, against ~0.36 s one by one in runs 45-47); that 768² first run
# 23.1 -> 8.2 s (run 47). `run_compiling_ahead` runs a function once so: a kernel without a binary is submitted
# to a thread pool and that call runs the op's plain-torch reference instead (CompilingAhead, a NotWarmedUp);
# kernels already compiled run as usual.


class CompilingAhead(NotWarmedUp):
    """This launch's kernel is being compiled on the pool; the op runs its reference for this call."""
    reason = "its kernel is being compiled ahead"


_ahead_failed = set()       # kernel names whose warmup raised (logged once)
_ahead = threading.local()   # .state: the running run_compiling_ahead's bookkeeping, else absent/None
_executor = None
_PARALLEL = os.environ.get("SDACCEL_PARALLEL_COMPILE", "1") != "0"
_mode_cls = []   # [AsyncCompileMode or None] once looked up


def _async_compile_mode():
    if not _mode_cls:
        try:
            from triton.runtime._async_compile import AsyncCompileMode
            _mode_cls.append(AsyncCompileMode)
        except Exception:  # noqa: BLE001 - Triton < 3.4, or no Triton: compile as each kernel is reached
            _mode_cls.append(None)
    return _mode_cls[0]


def compile_ahead_available():
    """Whether `run_compiling_ahead` compiles in parallel here (else it just calls the function)."""
    return (_PARALLEL and not interpret_mode() and get_triton() is not None and torch.cuda.is_available()
            and _async_compile_mode() is not None)


def _pool():
    global _executor
    if _executor is None:
        from concurrent.futures import ThreadPoolExecutor
        # one thread a core, at most 16 (what was measured; each compilation holds its own LLVM working memory)
        _executor = ThreadPoolExecutor(max(1, min(16, os.cpu_count() or 1)), thread_name_prefix="sd_accel_compile")
    return _executor


def _submit_ahead(state, kernel, grid, args, meta):
    """True when `kernel` had no binary for these arguments and its compilation is now on the pool (or was
    already, earlier in this run); False when Triton has one and the launch can go ahead."""
    try:
        k = kernel.warmup(*args, grid=grid, **meta)   # under AsyncCompileMode: submits, never blocks
    except Exception as e:  # noqa: BLE001 - the launch below compiles it the usual way and says what failed
        name = getattr(kernel, "__name__", str(kernel))
        if name not in _ahead_failed:
            _ahead_failed.add(name)
            log.info("[SD Accel] %s cannot be compiled ahead (%s: %s); it compiles when launched",
                     name, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        return False
    if type(k).__name__ == "FutureKernel" and getattr(k, "kernel", None) is None:
        state["pending"].add(id(k))
        return True
    return False


def compiling_ahead():
    """True inside `run_compiling_ahead` (its reference fallbacks are not news: kernel_report keeps quiet)."""
    return getattr(_ahead, "state", None) is not None


def run_compiling_ahead(fn):
    """(fn(), compiled): fn run once with every Triton kernel it reaches that has no binary yet compiled on a
    thread pool, all of them waited for before returning. `compiled` counts those; when it is > 0 the ops that
    met them ran their reference, so the result is not the kernels' result and the caller calls fn again (now
    every kernel is compiled). When it is 0, fn ran exactly as a plain call would. Where the parallel path is
    unavailable this is (fn(), 0)."""
    mode_cls = _async_compile_mode() if compile_ahead_available() else None
    if mode_cls is None or compiling_ahead():
        return fn(), 0
    state = {"pending": set()}
    t0 = time.perf_counter()
    try:
        mode = mode_cls(_pool(), ignore_errors=True)
    except TypeError:   # Triton 3.4-3.5: no ignore_errors
        mode = mode_cls(_pool())
    _ahead.state = state
    try:
        with mode:   # leaving it waits for every submitted compilation and puts each into Triton's cache
            out = fn()
    except Exception as e:  # noqa: BLE001 - a failed compilation: the plain call compiles (and reports) again
        if not state["pending"]:
            raise
        log.warning("[SD Accel] compiling kernels ahead failed (%s: %s); compiling them one by one",
                    type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        return None, len(state["pending"])
    finally:
        _ahead.state = None
    n = len(state["pending"])
    if n:
        _prepare_launchers(mode)
        first_launches["ahead"] += n
        first_launches["ahead_seconds"] += time.perf_counter() - t0
        log.info("[SD Accel] compiled %d Triton kernels in parallel in %.1f s", n, time.perf_counter() - t0)
    return out, n


def _prepare_launchers(mode):
    """Triton (up to 3.6 at least) builds each compiled kernel's host launcher at its first launch, a C module
    compiled with the system compiler per argument signature, one after the other (device runs 45-46 still
    spent 3.5 s in the first launches after compiling ahead; run 47, with this, 0.03 s). Building them here on
    the pool puts them in Triton's on-disk cache, so the first launch only loads them. The objects built are
    dropped: the kernel makes its own at its first launch, on the launching thread (it also loads the binary
    onto the GPU then). Best effort: any failure leaves it all to the first launch."""
    try:
        from triton.runtime import driver
        make = driver.active.launcher_cls
        kernels = [f.kernel for f in getattr(mode, "future_kernels", {}).values() if getattr(f, "kernel", None)]
        kernels = [k for k in kernels if getattr(k, "src", None) is not None and getattr(k, "module", 1) is None]
    except Exception:  # noqa: BLE001
        return
    futures = [_pool().submit(make, k.src, k.metadata) for k in kernels]
    for f in futures:
        try:
            f.result()
        except Exception:  # noqa: BLE001 - the first launch builds it and reports what fails
            pass
