"""Capturing a step into a CUDA graph so that a failure leaves nothing broken.

Inside `capturing(graph, pool, inputs, host_values)`:
  * the garbage collector is paused: a collection frees the CUDA tensors the garbage held (a dropped LoRA
    variant's clone, say), and a free issued during a capture of memory allocated outside it aborts the process
    under cudaMallocAsync;
  * the capture runs on a side stream in thread-local mode (another thread's CUDA calls neither break it nor
    are refused), without emptying the allocator's cache first (torch.cuda.graph() does; under a VRAM Pool a
    capture follows every prompt's reshuffle, and the blocks given back would be allocated anew);
  * torch's sync debug mode is "error", and explicit waits (waits.py) raise: an operation that would wait for
    the GPU (which a capture forbids and which invalidates it) raises before it reaches CUDA, so the capture can
    still be ended cleanly;
  * reads of graph inputs on the host are answered from host copies (host_reads.py);
  * the libraries' per-stream state is made before the capture begins (`warm_libraries`): cuBLAS allocates a
    workspace for each (handle, stream) the first time it runs there and keeps it. Allocated inside a capture,
    that workspace is the capture's memory; after a failed capture (never replayed) every later GEMM on the
    side stream, in the next key's graph, uses memory that was never there ("unspecified launch failure",
    then an abort).
If the capture is invalidated anyway (a wait issued from C code, out of reach of both), `recover` ends what
torch left open: the allocator's capture pool and the CUDA generator's capture mode; what the capture allocated
is kept alive (`keep_until_exit`: freeing it aborts under cudaMallocAsync). Under cudaMallocAsync that is not a
full repair (the driver hands the invalidated capture's addresses out again while torch still books them), which
is why the probe and the guards above exist: the common cases never reach an invalidated capture.
"""
import contextlib
import ctypes
import gc
import logging
import traceback

import torch

from .host_reads import HostReads, sync_debug
from .waits import Waits

log = logging.getLogger("sd_accel")
_STREAMS = {}
_KEPT = []


class CaptureInvalidated(RuntimeError):
    """CUDA invalidated the capture (an operation it could not record); torch's capture state was repaired."""


@contextlib.contextmanager
def gc_paused():
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _side_stream():
    device = torch.cuda.current_device()
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream()
    return stream


# (dtype, bias): plain GEMMs (cuBLAS) and GEMMs with a bias epilogue (cuBLASLt), each library's workspace
_WARM_GEMMS = ((torch.float16, False), (torch.float16, True), (torch.bfloat16, True), (torch.float32, False),
               (torch.float32, True))


def warm_libraries():
    """Tiny GEMMs on the current stream, outside any capture, so that cuBLAS and cuBLASLt have this thread's
    handle and this stream's workspace before a capture begins (torch's documented side-stream warm-up,
    reduced to what persists). A few microseconds per capture."""
    for dtype, bias in _WARM_GEMMS:
        a = torch.ones(16, 16, device="cuda", dtype=dtype)
        torch.nn.functional.linear(a, a, a[0] if bias else None)


@contextlib.contextmanager
def _on_side_stream(graph, pool):
    stream = _side_stream()
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        warm_libraries()
        try:
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        except RuntimeError as e:     # an allocator refused to begin: `capturing` undoes what it began
            raise CaptureInvalidated(str(e)) from e
        try:
            yield
        finally:
            try:
                graph.capture_end()
            except RuntimeError as e:
                raise CaptureInvalidated(str(e)) from e
    current.wait_stream(stream)


@contextlib.contextmanager
def capturing(graph, pool, inputs=(), host_values=None):
    with gc_paused():
        try:
            with HostReads(inputs, host_values or {}), Waits(raise_=True), sync_debug(2), \
                    _on_side_stream(graph, pool):
                yield
        except CaptureInvalidated:
            recover(pool)   # outside the guards: its own wait for the device must not be refused
            raise


def recover(pool):
    """After an invalidated capture: close the allocator's capture pool, take the CUDA generator out of
    capture mode (an empty capture runs its prologue and epilogue), and wait for the device."""
    device = torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(device, pool)
    except (RuntimeError, AttributeError) as e:
        log.debug("[SD Accel] allocator pool after a failed capture: %s", e)
    try:
        empty = torch.cuda.CUDAGraph()
        with torch.cuda.stream(_side_stream()):
            empty.capture_begin(capture_error_mode="thread_local")
            empty.capture_end()
        keep_until_exit(empty)
    except RuntimeError as e:
        log.warning("[SD Accel] could not reset the CUDA generator after a failed capture: %s", e)
    torch.cuda.synchronize()


def keep_failed_capture(error, *items):
    """After a failed capture: keeps `items` (the graph, its pool, its inputs) and every tensor the traceback's
    frames held (what the capture allocated up to the failure), then clears those frames. The frames themselves
    are not kept: they hold the step's closure, and with it the model, which must be freed when the host drops
    it."""
    tensors = []
    tb = error.__traceback__
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            tensors.extend(_tensors_in(value))
        tb = tb.tb_next
    keep_until_exit((tensors,) + items)
    traceback.clear_frames(error.__traceback__)
    error.__traceback__ = None


def _tensors_in(value, depth=2):
    if isinstance(value, torch.Tensor):   # weights were allocated before the capture: freeing them is safe
        return [] if isinstance(value, torch.nn.Parameter) or not value.is_cuda else [value]
    if depth == 0:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v, depth - 1)]
    return []


def keep_until_exit(item):
    """Keeps `item` alive for good, interpreter teardown included (freeing at exit aborts just the same). The
    list gets one reference no one drops, so Python's finalization never frees it; the OS and the driver
    reclaim the memory when the process ends."""
    if not _KEPT:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_KEPT))
    _KEPT.append(item)
