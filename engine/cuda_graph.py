"""CUDA-graph replay of one denoising step.

`StepGraphs.run(fn, args, kwargs)` calls `fn(*args, **kwargs)` through a CUDA graph when it can:
  * the call's structure is its key: every non-tensor leaf (by value, or by identity for objects such
    as patch callables), every tensor's shape/dtype/stride/device, plus the weights fingerprint;
  * every tensor leaf is copied into a static buffer before each replay (x, sigma, conds, ControlNet
    residuals), so the replay sees this step's values;
  * the first call with a new key runs eagerly (warm-up: Triton JIT, cuDNN/cuBLAS set-up), the second
    captures, later ones replay. A key warmed up once keeps that for as long as this object lives: after
    the weights changed (a LoRA, ComfyUI reloading a partially loaded model for the next prompt) its first
    call captures at once. What a warm-up prepares belongs to the shapes, not to the weights. Should such
    a capture fail anyway, that call runs eagerly as a warm-up and the next one captures again.
Never a stale graph: the weights fingerprint (identity, storage pointer and version counter of every
parameter and buffer) is checked on every call; when it changes (a LoRA patched or re-weighted, the
model moved or offloaded, another model loaded into the same object) all graphs are dropped.
Graphs are not used when any weight is off the GPU (CPU, offloaded or partially loaded weights), or
while another capture is under way; weights streamed into fixed places (engine/offload.py) are on the GPU
for this purpose, and the streamer's token (WEIGHTS_TOKEN) is part of the fingerprint. Inputs the host
keeps on the CPU until the model moves them (ComfyUI's
conds) get GPU static buffers: the model's own move then happens on the GPU, inside the graph.

Memory: all graphs of one model share one private memory pool; each graph's static inputs and output
stay referenced for as long as the graph lives (under ComfyUI's default cudaMallocAsync allocator, a
capture after a graph's output was freed outside the graph fails), at most `max_graphs` keys are kept
and dropping one drops the whole pool, so graph memory is bounded and freed as a unit.
"""
import contextlib
import ctypes
import enum
import gc
import logging
import os
import threading
import uuid
from collections import OrderedDict

import torch

from ..kernels import _triton
from . import kernel_report

log = logging.getLogger("sd_accel")
DIAG_LEVEL = logging.WARNING if os.environ.get("SDACCEL_DIAG") == "1" else logging.DEBUG


# set on the weights module by whatever puts its weights' bytes somewhere the fingerprint cannot see (the block
# streamer's ring and host buffers: engine/offload.py), a new object each time: part of the fingerprint
WEIGHTS_TOKEN = "sd_accel_weights_token"
SMALL_HOST_TENSOR = 256   # CPU tensors up to this size are schedule metadata: keyed by value
# Off by default; SDACCEL_CUDNN_AUTOTUNE=1 turns it on. Not measured to help: torch keeps one cuDNN plan per
# convolution shape whichever way it was chosen (heuristics or timing), so an A/B inside one process times the
# same plans (device run 48's +4% was drift), and across processes it/s varies more than any gain. What was
# measured is the cost: a cold process's first run 17.4 s with it against 6.0 s without (run 50; presumably
# cuDNN building and timing every candidate plan of each new convolution shape, not isolated).
CUDNN_AUTOTUNE = os.environ.get("SDACCEL_CUDNN_AUTOTUNE", "0") == "1"
_under_budget = [0]   # depth of under_vram_budget scopes (a VRAM Pool's budgeted run)
# torch.cuda.graph() empties the allocator's cache (newer torch also the pinned host cache) before every
# capture, to make room for the graph. Under a VRAM Pool's lowvram budget a capture follows every prompt's
# reshuffle (ComfyUI reloads the UNet's share at new addresses), and the blocks given back are then
# allocated anew by the capture and the steps after it. Captures here begin on a side stream without that;
# True (or SDACCEL_CAPTURE_EMPTY_CACHE=1) captures through torch.cuda.graph() as before.
CAPTURE_EMPTIES_CACHE = os.environ.get("SDACCEL_CAPTURE_EMPTY_CACHE", "0") == "1"
_CAPTURE_STREAMS = {}
AHEAD_PASSES = 3   # eager_call: passes that may compile kernels ahead before the plain call


@contextlib.contextmanager
def cudnn_autotuned(on=True):
    """cuDNN picks each convolution's algorithm by timing the candidates (`cudnn.benchmark`) inside the
    scope, and the previous setting is restored after. Used for a graph's warm-up call and its capture
    only: the warm-up times each new conv shape once (cuDNN caches the choice per shape, dtype and
    layout), the capture then finds every choice cached, and replays run what was captured. Stock
    ComfyUI leaves it off unless started with `--fast autotune`. Same arithmetic, another algorithm:
    lossless within fp16 noise (device run 49: PSNR vs stock 52.5 dB, as without)."""
    if not on:
        yield
        return
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = old


def eager_call(fn, args, kwargs):
    """fn(*args, **kwargs), with the Triton kernels it reaches for the first time compiled in parallel
    (kernels/_triton.run_compiling_ahead): when any were, that first pass ran their references and is
    discarded (with what it added to the kernel report), and fn runs again on the compiled kernels. Once every
    kernel is compiled this is the plain call. Not inside a capture: a capture never compiles."""
    if _under_budget[0] or not _triton.compile_ahead_available() or torch.cuda.is_current_stream_capturing():
        return fn(*args, **kwargs)
    before = kernel_report.snapshot()
    # kernels behind a reference's result can differ from those behind a kernel's, so a pass that compiled
    # something is followed by another (device run 46: 50 of a 768² step's kernels in up to three passes,
    # against 44 in one); a pass that compiled nothing is the plain call's result
    for _ in range(AHEAD_PASSES):
        out, compiled = _triton.run_compiling_ahead(lambda: fn(*args, **kwargs))
        if not compiled:
            return out
        kernel_report.rollback(before)
    return fn(*args, **kwargs)


@contextlib.contextmanager
def under_vram_budget():
    """A VRAM Pool run under a budget: nothing here may allocate beyond what the plan counted. No cuDNN
    autotuning (timing the candidates allocates their workspaces) and no compiling ahead (its pass runs the
    plain-torch references, whose temporaries are larger than the fused kernels': SDXL's GEGLU ~0.17 GiB
    more), so a cold Triton cache compiles one kernel at a time there."""
    _under_budget[0] += 1
    try:
        yield
    finally:
        _under_budget[0] -= 1


def autotune_now():
    return CUDNN_AUTOTUNE and not _under_budget[0]


def _flatten(obj, tensors, key, ignore=()):
    """Appends GPU tensor leaves to `tensors` and a hashable description of the structure to `key`.

    A small CPU tensor (sigma schedules and the like, read by Python-side logic such as ControlNet
    start/end percent) is part of the key by value: a graph captured for other values is not reused.
    A large CPU tensor is a GPU input the host did not move: it makes the call ineligible."""
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            tensors.append(obj)
            key.append(("T", tuple(obj.shape), obj.dtype, obj.stride(), obj.device))
        elif obj.numel() <= SMALL_HOST_TENSOR:
            key.append(("C", tuple(obj.shape), obj.dtype, tuple(obj.reshape(-1).tolist())))
        else:
            # conds live on the CPU until apply_model moves them: the graph gets a GPU copy instead
            tensors.append(obj)
            key.append(("X", tuple(obj.shape), obj.dtype, obj.stride(), obj.device))
    elif isinstance(obj, dict):
        key.append(("D", len(obj)))
        for k in obj:
            key.append(k if isinstance(k, (str, int)) else repr(k))
            if k in ignore and not isinstance(obj[k], torch.Tensor):
                continue   # passed through to the call, left out of the key
            _flatten(obj[k], tensors, key, ignore)
    elif isinstance(obj, (list, tuple)):
        key.append(("L" if isinstance(obj, list) else "U", len(obj)))
        for v in obj:
            _flatten(v, tensors, key, ignore)
    elif obj is None or isinstance(obj, (bool, int, float, str, torch.dtype, torch.device, uuid.UUID, enum.Enum)):
        key.append(obj)
    else:
        key.append(("O", id(obj)))   # patches, wrappers: a different object means a different graph


def _rebuild(obj, it):
    if isinstance(obj, torch.Tensor):
        return next(it) if obj.is_cuda or obj.numel() > SMALL_HOST_TENSOR else obj
    if isinstance(obj, dict):
        return {k: _rebuild(v, it) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, it) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_rebuild(v, it) for v in obj)
    return obj


def _static_copy(t, device=None):
    s = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device or t.device)
    s.copy_(t)
    return s


class WeightsFingerprint:
    """Cheap identity of a module's weights: (id, data_ptr, _version) of every parameter and buffer,
    read through the owning modules' dicts so replaced Parameter objects are seen (ComfyUI patches a
    LoRA in by replacing the Parameter, or in place, which bumps `_version`).

    Walking the module tree costs ~0.5 ms for SD1.5 (843 modules) and reading every slot's pointer and version
    ~0.36 ms (782 slots, this repo's CPU machine), on every step. So within one sampling run (the caller's
    `epoch`): the tree is walked at its first step only (the host swaps modules, object patches, when it
    loads the model, before that step), and a later step re-reads the slots only when a tensor object or a
    version counter changed (~0.05 ms): a Parameter replaced mid-run (a patch, a LoRA hook) or an in-place
    write to a tensor with a version counter (A1111's LoRA) is still seen at once; a `.data` swap of the same
    Parameter mid-run, which no host does, is seen at the next run's first step. Without an epoch (None)
    every read is full."""

    def __init__(self, module):
        self.module = module
        self.slots = []
        self.epoch = _NO_EPOCH
        self._last = None     # this epoch's last full read: (slot ids, [(slot, version)], result)

    def refresh(self):
        self.slots = [(d, name) for m in self.module.modules() for d in (m._parameters, m._buffers) for name in d]

    def read(self, epoch=None):
        if epoch is None or epoch is not self.epoch:
            self.refresh()
            self.epoch = epoch
            self._last = None
        tensors = [d.get(name) for d, name in self.slots]
        ids = list(map(id, tensors))
        last = self._last
        if last is not None and ids == last[0] and all(tensors[i]._version == v for i, v in last[1]):
            return last[2]
        out, versioned = [], []
        all_cuda = True
        for i, t in enumerate(tensors):
            if t is None:
                out.append(None)
                continue
            if not t.is_cuda:
                all_cuda = False
            # inference tensors (ComfyUI loads weights under inference_mode) have no version counter;
            # for them an in-place update is caught by the host's own patch state (`host_state`)
            version = 0
            if not t.is_inference():
                version = t._version
                versioned.append((i, version))
            out.append((id(t), t.data_ptr(), version))
        result = (tuple(out), all_cuda)
        if epoch is not None:
            self._last = (ids, versioned, result)
        return result


@contextlib.contextmanager
def _gc_paused():
    """No garbage collection while capturing. A collection frees the CUDA tensors the garbage held (a dropped
    LoRA variant's clone and its weight backups, say), and a free issued during a capture of memory allocated
    outside it aborted the process under cudaMallocAsync ("Fatal Python error: Aborted", garbage-collecting
    inside the capture: device run 57). torch.cuda.graph() collects before it captures for this reason; an
    automatic collection during the capture could still start. The garbage is collected after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def _capturing(graph, pool):
    """Captures the work issued inside into `graph` (private memory `pool`), as torch.cuda.graph() does:
    on a side stream that first waits for the current one, which then waits for it; the garbage collector
    paused meanwhile (`_gc_paused`)."""
    with _gc_paused():
        with _capturing_on_side_stream(graph, pool):
            yield


@contextlib.contextmanager
def _capturing_on_side_stream(graph, pool):
    if CAPTURE_EMPTIES_CACHE:
        with torch.cuda.graph(graph, pool=pool):
            yield
        return
    device = torch.cuda.current_device()
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream()
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            yield
        finally:
            graph.capture_end()
    current.wait_stream(stream)


_NO_EPOCH = object()
_FAILED_CAPTURES = []     # what failed captures allocated, kept alive (see StepGraphs._capture)


def _keep_until_exit(item):
    """Keeps `item` (what a failed capture allocated) alive for good, interpreter teardown included: freeing it
    at exit aborted the process just the same (device run 61, after a failed capture's prompt had completed).
    The list gets one reference no one drops, so Python's finalization never frees it; the OS and the CUDA
    driver reclaim the memory when the process ends."""
    if not _FAILED_CAPTURES:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_FAILED_CAPTURES))
    _FAILED_CAPTURES.append(item)


_running = threading.local()   # depth of StepGraphs calls running their function (warm-up or capture)


@contextlib.contextmanager
def _step_running():
    _running.depth = getattr(_running, "depth", 0) + 1
    try:
        yield
    finally:
        _running.depth -= 1


class _Entry:
    __slots__ = ("graph", "static_in", "static_out", "kernel_calls")


class StepGraphs:
    """Graphs for one model (one UNet, or UNet + ControlNets called as one step)."""

    def __init__(self, weights_module, max_graphs=4, name="unet"):
        self.name = name
        self.max_graphs = max_graphs
        self.fp = WeightsFingerprint(weights_module)
        self.last_fp = None
        self.entries = OrderedDict()
        self.warm = set()
        self.warmed_before = OrderedDict()   # keys warmed up before (bounded), kept when the graphs are dropped
        self.broken = set()       # keys whose capture failed: always eager
        self.pool = None
        self.stats = {"captures": 0, "replays": 0, "eager": 0, "invalidations": 0}
        self.last_eager_reason = None

    def clear(self, why=None):
        log.log(DIAG_LEVEL, "[SD Accel] clear graphs of %s: %s (%d entries)", self.name, why, len(self.entries))
        if self.entries or self.warm:
            self.stats["invalidations"] += 1
            if why:
                log.info("[SD Accel] CUDA graphs for %s dropped: %s", self.name, why)
        self.entries.clear()
        self.warm.clear()
        self.pool = None

    def clear_if_offloaded(self):
        """Frees the graph memory once the weights have left the GPU (the host unloaded the model);
        while they stay, the graphs stay valid (the fingerprint checks them on every step)."""
        p = next(self.fp.module.parameters(), None)
        if p is None or not p.is_cuda:
            self.clear("model unloaded")

    def _remember_warmed(self, key):
        self.warmed_before[key] = True
        while len(self.warmed_before) > 4 * self.max_graphs:
            self.warmed_before.popitem(last=False)

    def _eager(self, fn, args, kwargs, reason):
        self.stats["eager"] += 1
        self.last_eager_reason = reason
        return eager_call(fn, args, kwargs)

    def run(self, fn, args, kwargs, epoch=None, host_state=None, key_ignore=()):
        """`epoch`: an object that stays the same for all steps of one sampling run (None: unknown,
        re-read the module tree on every call). `host_state`: the host's own word for which weight
        patches are applied (ComfyUI: `current_weight_patches_uuid`); a change drops the graphs."""
        if getattr(_running, "depth", 0):
            # a model called inside another model's step (ControlNets inside the UNet's graph): it is part
            # of that step's warm-up or capture, and never gets graphs of its own that would only hold memory
            return self._eager(fn, args, kwargs, "inside another model's step")
        if not torch.cuda.is_available():
            return self._eager(fn, args, kwargs, "no CUDA device")
        if torch.cuda.is_current_stream_capturing():
            return self._eager(fn, args, kwargs, "another capture is under way")
        fp, all_cuda = self.fp.read(epoch)
        fp = (fp, host_state, getattr(self.fp.module, WEIGHTS_TOKEN, None))
        if not all_cuda:
            self.clear()
            return self._eager(fn, args, kwargs, "weights not all on the GPU (offloaded or partially loaded)")
        if fp != self.last_fp:
            if self.last_fp is not None:
                self.clear("weights changed (LoRA/patch, reload or device move)")
            self.last_fp = fp
        tensors, key = [], []
        _flatten((args, kwargs), tensors, key, key_ignore)
        device = next((t.device for t in tensors if t.is_cuda), None)
        if device is None:
            return self._eager(fn, args, kwargs, "no input on the GPU")
        if any(t.device.type not in ("cuda", "cpu") for t in tensors):
            return self._eager(fn, args, kwargs, "inputs on another device")
        key = tuple(key)
        entry = self.entries.get(key)
        if entry is None:
            if key in self.broken:
                return self._eager(fn, args, kwargs, "this call cannot be captured")
            rewarm = key in self.warmed_before and key not in self.warm
            if key not in self.warm and not rewarm:
                if self.entries or self.warm:
                    other = next(iter(self.entries)) if self.entries else next(iter(self.warm))
                    log.log(DIAG_LEVEL, "[SD Accel] new graph key for %s: %s", self.name, _key_diff(key, other))
                self.warm.add(key)
                self._remember_warmed(key)
                with cudnn_autotuned(autotune_now()), _step_running():
                    return self._eager(fn, args, kwargs, "warm-up call for a new shape")
            entry = self._capture(fn, args, kwargs, tensors, key, device, retry_after_warmup=rewarm)
            if entry is None:
                return self._eager(fn, args, kwargs, "capture failed")
            fresh = True   # its kernels were counted while capturing
        else:
            self.entries.move_to_end(key)
            fresh = False
        for s, t in zip(entry.static_in, tensors):
            s.copy_(t, non_blocking=True)
        entry.graph.replay()
        self.stats["replays"] += 1
        if entry.kernel_calls and not fresh:
            kernel_report.replayed(entry.kernel_calls)
        return _map_tensors(entry.static_out, lambda t: t.clone())

    def _capture(self, fn, args, kwargs, tensors, key, device, retry_after_warmup=False):
        """`retry_after_warmup`: the key skipped its warm-up (it was warmed before the weights changed); if
        the capture fails, this call's eager run is its warm-up and the next call tries again."""
        if len(self.entries) >= self.max_graphs:
            self.clear("more than %d shapes in use" % self.max_graphs)
            self.warm.add(key)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        entry = _Entry()
        entry.static_in = [_static_copy(t, device) for t in tensors]   # CPU conds get GPU buffers
        it = iter(entry.static_in)
        s_args, s_kwargs = _rebuild((args, kwargs), it)
        graph = torch.cuda.CUDAGraph()
        k0 = kernel_report.snapshot()
        try:
            torch.cuda.synchronize()
            with cudnn_autotuned(autotune_now()), _capturing(graph, self.pool), _step_running():
                out = fn(*s_args, **s_kwargs)
        except Exception as e:  # an op that cannot be captured: remember and run eagerly
            log.warning("[SD Accel] CUDA graph capture failed for %s (%s: %s); running eagerly",
                        self.name, type(e).__name__, str(e).splitlines()[0][:200])
            log.log(DIAG_LEVEL, "[SD Accel] where the capture failed", exc_info=True)
            # The tensors the failed capture allocated are still referenced by the traceback's frames, the graph
            # and its pool. Under cudaMallocAsync, freeing an allocation of an invalidated capture aborted the
            # process ("invalid argument" in free_impl, device run 19): all of it is kept instead (one entry
            # per key that failed, and a failed key is never captured again)
            _keep_until_exit((e, graph, self.pool, entry.static_in))
            self.clear()
            if retry_after_warmup:
                self.warm.add(key)
            else:
                self.broken.add(key)
            return None
        entry.graph = graph
        entry.static_out = out
        # which fused kernels (or fallbacks) the graph holds: counted again on every replay
        entry.kernel_calls = kernel_report.calls_between(k0, kernel_report.snapshot())
        self.entries[key] = entry
        self.stats["captures"] += 1
        return entry


def _key_diff(a, b):
    """First differing positions of two graph keys, for the debug log when a graph is recaptured."""
    diffs = [(i, x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return diffs[:3] if diffs or len(a) == len(b) else "length %d vs %d" % (len(a), len(b))


def _map_tensors(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj
