"""Running a step without a graph: its warm-up (compiling kernels ahead) and the path a refused call takes.

* `eager_call`: fn(*args, **kwargs), with the Triton kernels it reaches for the first time compiled in
  parallel (kernels/_triton.run_compiling_ahead): when any were, that first pass ran their references and fn
  runs again on the compiled kernels (kernels behind a reference's result can differ from those behind a
  kernel's, so a pass that compiled something is followed by another, up to AHEAD_PASSES). A pass is repeated
  only where `repeatable()` says a second run changes nothing (a probe finding Python state, host reads or
  random draws stops it: a stateful wrapper must run once per step, as in stock). Not inside a capture.
* `EagerPaths`: where graphs do not run, the fused modules are not always faster than stock: each launch of a
  fused kernel costs host time, and a host-bound step pays it. So a key that runs eagerly times both paths
  (the fused modules and the stock ones, `stock_path.stock_modules`) with CUDA events, twice each, and keeps
  the faster. On the CPU the stock path runs, except under TRITON_INTERPRET=1 (the kernels' interpreter,
  which asks for the fused path). Under autograd (`under_autograd`) the stock path runs, unmeasured.
"""
import contextlib
import os
from collections import OrderedDict

import torch

from ...kernels import _triton
from ..reports import kernel_report
from ..patches import stock_path
from . import rerun

# Off by default; SDACCEL_CUDNN_AUTOTUNE=1 turns it on. torch keeps one cuDNN plan per convolution shape
# whichever way it was chosen, so no gain was measured, while a cold process's first run took about three
# times as long with it (bench/RESULTS.md, "cuDNN autotuning").
CUDNN_AUTOTUNE = os.environ.get("SDACCEL_CUDNN_AUTOTUNE", "0") == "1"
AHEAD_PASSES = 3
SAMPLES = 2          # timed eager calls per path before EagerPaths chooses
FORCED_PATH = os.environ.get("SDACCEL_EAGER_PATH")   # "stock" or "fused": a diagnosis switch (docs/internals.md)
_under_budget = [0]  # depth of under_vram_budget scopes (a VRAM Pool's budgeted run)
AUTOGRAD = "autograd is on (a training node): the stock modules run, as without SD Accel"


def under_autograd():
    """True where autograd records the step: outside ComfyUI's inference mode and torch.no_grad (ComfyUI's Train
    LoRA node turns inference mode off around its steps). The stock modules run there: the fused kernels compute
    forward only (with autograd each falls back to its reference, which rounds otherwise than stock's op) and a
    graph's replay records no gradient at all."""
    return torch.is_grad_enabled()


@contextlib.contextmanager
def cudnn_autotuned(on=True):
    """cuDNN picks each convolution's algorithm by timing the candidates inside the scope (`cudnn.benchmark`),
    restored after. Same arithmetic, another algorithm: lossless within fp16 noise."""
    if not on:
        yield
        return
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = old


@contextlib.contextmanager
def under_vram_budget():
    """A VRAM Pool run under a budget: nothing here may allocate beyond what the plan counted. No cuDNN
    autotuning (timing the candidates allocates their workspaces) and no compiling ahead (its pass runs the
    plain-torch references, whose temporaries are larger than the fused kernels')."""
    _under_budget[0] += 1
    try:
        yield
    finally:
        _under_budget[0] -= 1


def budgeted():
    """True inside an `under_vram_budget` scope."""
    return _under_budget[0] > 0


def autotune_now():
    return CUDNN_AUTOTUNE and not _under_budget[0]


def eager_call(fn, args, kwargs, repeatable=None):
    """See the module doc."""
    if _under_budget[0] or not _triton.compile_ahead_available() or torch.cuda.is_current_stream_capturing():
        return fn(*args, **kwargs)
    before = kernel_report.snapshot()
    given = rerun.Containers((args, kwargs))   # what a pass consumes (the UNet pops the control lists)
    for _ in range(AHEAD_PASSES):
        out, compiled = _triton.run_compiling_ahead(lambda: fn(*args, **kwargs))
        if not compiled or (repeatable is not None and not repeatable()):
            return out
        kernel_report.rollback(before)
        given.restore()
    return fn(*args, **kwargs)


def _interpreting():
    return os.environ.get("TRITON_INTERPRET") == "1"


class _Timing:
    __slots__ = ("samples", "pending", "choice")

    def __init__(self):
        self.samples = {"fused": [], "stock": []}
        self.pending = []        # (path, start event, end event)
        self.choice = None


class EagerPaths:
    """Per key, the eager path that measured faster (see the module doc). Bounded: the oldest keys go."""

    def __init__(self, max_keys=32):
        self.by_key = OrderedDict()
        self.max_keys = max_keys
        self.stock_calls = 0      # calls that ran the stock modules (for the run report)
        # () -> a context manager around each stock-path call, or None: the host's cheaper stock tree for the
        # call, where it has one (hosts/comfyui/stock_blocks.py)
        self.stock_scope = None

    def run(self, key, fn, args, kwargs, device, stock_scope=None):
        """fn(*args, **kwargs) on `key`'s path. `stock_scope`: this call's own in place of `self.stock_scope`."""
        with self.path_for(key, device, stock_scope):
            return fn(*args, **kwargs)

    @contextlib.contextmanager
    def path_for(self, key, device, stock_scope=None):
        """The code inside runs on `key`'s eager path (`run`'s, for a call the caller makes itself: a host that
        can only wrap a call in hooks)."""
        held = "stock" if under_autograd() else FORCED_PATH
        if held in ("stock", "fused"):
            with self._path(held, stock_scope):
                yield
            return
        if device is None or device.type != "cuda":
            with self._path("fused" if _interpreting() else "stock", stock_scope):
                yield
            return
        timing = self._timing(key)
        _collect(timing)
        path = timing.choice or _next_path(timing)
        if timing.choice is not None:
            with self._path(path, stock_scope):
                yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with self._path(path, stock_scope):
            yield
        end.record()
        timing.pending.append((path, start, end))

    def choice(self, key):
        t = self.by_key.get(key)
        return t.choice if t is not None else None

    def choices(self):
        """{path: keys that chose it} so far."""
        out = {}
        for t in self.by_key.values():
            if t.choice is not None:
                out[t.choice] = out.get(t.choice, 0) + 1
        return out

    def _timing(self, key):
        t = self.by_key.get(key)
        if t is None:
            t = self.by_key[key] = _Timing()
            while len(self.by_key) > self.max_keys:
                self.by_key.popitem(last=False)
        return t

    def run_stock(self, fn, args, kwargs):
        """fn on the stock modules, whatever was measured."""
        with self._path("stock"):
            return fn(*args, **kwargs)

    @contextlib.contextmanager
    def _path(self, path, stock_scope=None):
        if path == "stock":
            self.stock_calls += 1
            scope = stock_scope or self.stock_scope
            tree = scope() if scope is not None else contextlib.nullcontext()
            with stock_path.stock_modules(), tree:
                yield
        else:
            yield


def _next_path(timing):
    taken = {p: len(s) + sum(1 for q, _, _ in timing.pending if q == p) for p, s in timing.samples.items()}
    return "stock" if taken["stock"] < taken["fused"] else "fused"


def _collect(timing):
    """Moves finished timings into the samples (no wait: only events already done), then chooses."""
    still = []
    for path, start, end in timing.pending:
        if end.query():
            timing.samples[path].append(start.elapsed_time(end))
        else:
            still.append((path, start, end))
    timing.pending = still
    s = timing.samples
    if timing.choice is None and all(len(v) >= SAMPLES for v in s.values()):
        timing.choice = "fused" if sorted(s["fused"])[0] < sorted(s["stock"])[0] else "stock"
