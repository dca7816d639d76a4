"""Compiling a step's Triton kernels in parallel, ahead of their first launch.

On a cold Triton cache (a user's first run, or any run after a Triton or driver upgrade) the first UNet
step compiles each of its kernels one after the other as it reaches them, which takes most of that run's
time (bench/RESULTS.md has the figures). Triton releases the GIL for part of its work (its MLIR/LLVM
passes, ptxas in a subprocess), and it can hand its compilations to an executor
(`triton.runtime._async_compile.AsyncCompileMode`, Triton >= 3.4). `run_compiling_ahead` runs a function
once so: a kernel without a binary is submitted to a thread pool and that call runs the op's plain-torch
reference instead (CompilingAhead, a NotWarmedUp); kernels already compiled run as usual.

This is the only file that uses Triton's private APIs (`_async_compile`, `driver.active.launcher_cls`);
where they are missing it does nothing and every kernel compiles when it is first launched.
"""
import logging
import os
import time

import torch

from . import _triton
from ._launch import NotWarmedUp, cold_launch, first_launches
from .errors import first_line

log = logging.getLogger("sd_accel")
_PARALLEL = os.environ.get("SDACCEL_PARALLEL_COMPILE", "1") != "0"


class CompilingAhead(NotWarmedUp):
    """This launch's kernel is being compiled on the pool; the op runs its reference for this call."""
    reason = "its kernel is being compiled ahead"


_ahead_failed = set()   # kernel names whose warmup raised (logged once)
_executor = None
_mode_cls = []          # [AsyncCompileMode or None] once looked up


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
    return (_PARALLEL and not _triton.interpret_mode() and _triton.get_triton() is not None
            and torch.cuda.is_available() and _async_compile_mode() is not None)


def _pool():
    global _executor
    if _executor is None:
        from concurrent.futures import ThreadPoolExecutor
        # one thread a core, at most 16: as far as it was measured, and each compilation holds its own LLVM
        # working memory
        _executor = ThreadPoolExecutor(max(1, min(16, os.cpu_count() or 1)), thread_name_prefix="sd_accel_compile")
    return _executor


class _Pass:
    """One run_compiling_ahead call: the compilations it put on the pool."""

    def __init__(self):
        self.pending = set()

    def submit(self, kernel, grid, args, meta):
        """Raise CompilingAhead when `kernel` has no binary for these arguments and its compilation is now on
        the pool (or was already, earlier in this pass); return when Triton has one and the launch can go
        ahead, or when it cannot be compiled ahead (the launch compiles it and says what failed)."""
        name = getattr(kernel, "__name__", str(kernel))
        try:
            k = kernel.warmup(*args, grid=grid, **meta)   # under AsyncCompileMode: submits, never blocks
        except Exception as e:  # noqa: BLE001
            if name not in _ahead_failed:
                _ahead_failed.add(name)
                log.info("[SD Accel] %s cannot be compiled ahead (%s: %s); it compiles when launched",
                         name, type(e).__name__, first_line(e))
            return
        if type(k).__name__ == "FutureKernel" and getattr(k, "kernel", None) is None:
            self.pending.add(id(k))
            raise CompilingAhead(name)


def compiling_ahead():
    """True inside `run_compiling_ahead` (its reference fallbacks are not news: kernel_report keeps quiet)."""
    return cold_launch.submit_ahead is not None


def _mode(mode_cls):
    try:
        return mode_cls(_pool(), ignore_errors=True)
    except TypeError:   # Triton 3.4-3.5: no ignore_errors
        return mode_cls(_pool())


def run_compiling_ahead(fn):
    """(fn(), compiled): fn run once with every Triton kernel it reaches that has no binary yet compiled on a
    thread pool, all of them waited for before returning. `compiled` counts those; when it is > 0 the ops that
    met them ran their reference, so the result is not the kernels' result and the caller calls fn again (now
    every kernel is compiled). When it is 0, fn ran exactly as a plain call would. Where the parallel path is
    unavailable this is (fn(), 0)."""
    mode_cls = _async_compile_mode() if compile_ahead_available() else None
    if mode_cls is None or compiling_ahead():
        return fn(), 0
    this_pass = _Pass()
    t0 = time.perf_counter()
    mode = _mode(mode_cls)
    cold_launch.submit_ahead = this_pass.submit
    try:
        with mode:   # leaving it waits for every submitted compilation and puts each into Triton's cache
            out = fn()
    except Exception as e:  # noqa: BLE001 - a failed compilation: the plain call compiles (and reports) again
        if not this_pass.pending:
            raise
        log.warning("[SD Accel] compiling kernels ahead failed (%s: %s); compiling them one by one",
                    type(e).__name__, first_line(e))
        return None, len(this_pass.pending)
    finally:
        cold_launch.submit_ahead = None
    n = len(this_pass.pending)
    if n:
        _prepare_launchers(mode)
        first_launches["ahead"] += n
        first_launches["ahead_seconds"] += time.perf_counter() - t0
        log.info("[SD Accel] compiled %d Triton kernels in parallel in %.1f s", n, time.perf_counter() - t0)
    return out, n


def _prepare_launchers(mode):
    """Triton (up to 3.6 at least) builds each compiled kernel's host launcher at its first launch, a C module
    compiled with the system compiler per argument signature, one after the other: seconds of a first run
    even after compiling ahead. Building them here on the pool puts them in Triton's on-disk cache, so the
    first launch only loads them. The objects built are dropped: the kernel makes its own at its first launch,
    on the launching thread (it also loads the binary onto the GPU then). Best effort: any failure leaves it
    all to the first launch."""
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
