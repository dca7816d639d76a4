"""Decides, on a key's first (eager) call, whether a capture could reproduce the step; never by a failing capture.

A failed capture can leave torch's allocator and CUDA generator half in capture mode, and what it allocated
may already sit in another pack's Python state, freed later (under cudaMallocAsync that aborts the process).
So a key's first call runs eagerly, as its warm-up, while `probe` watches for what a replay would not repeat:
  * host reads of GPU values and other synchronisations (`.item()`, `bool(t)`, `.cpu()`, `nonzero`,
    `torch.cuda.synchronize()`): a Python decision taken on a value of this step. Reads of a graph input
    (Deep Shrink's sigma) are allowed: the key then holds that input's value (host_reads.py);
  * Python state the call changes (a counter, a cache of tensors kept by a wrapper, a list appended to):
    a replay would not change it again. Compared before and after, over every object reachable from the
    call's arguments (tokens.state_of);
  * draws from random generators: the call is run once more from the states it started with (so the result
    and the generators are what one stock call gives, however often compile-ahead ran it); draws on the host
    are allowed only when the result does not depend on them (rng.py).
A capturable verdict also names where the call's functions store in their modules (`writes`): a replay sets
what the capture stored there again (effects.py).
The verdict's reason is one line that names what was found and where.
"""
import warnings

import torch

from ..reports import kernel_report
from . import eager, rerun, rng, tokens
from .host_reads import HostReads
from .waits import Waits


class Verdict:
    __slots__ = ("reason", "input_reads", "note", "writes")

    def __init__(self, reason=None, input_reads=(), note=None, writes=()):
        self.reason = reason                  # None: capturable
        self.input_reads = tuple(input_reads)  # inputs whose values the step reads on the host
        self.note = note
        self.writes = tuple(writes)           # where the call's functions store in their modules (effects.py)

    @property
    def capturable(self):
        return self.reason is None


def objects_of(obj, out=None):
    """The non-container, non-tensor objects reachable through dicts, lists and tuples of `obj`."""
    out = [] if out is None else out
    if isinstance(obj, dict):
        for v in obj.values():
            objects_of(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            objects_of(v, out)
    elif not isinstance(obj, (torch.Tensor, tokens.Token) + tokens._PRIMITIVE) and not _inert(obj):
        out.append(obj)
    return out


def _inert(obj):
    mark = getattr(obj, tokens.INERT, None)
    return mark is not None and mark is not False


def _changed(objects, before):
    for obj, was in zip(objects, before):
        if tokens.state_of(obj) != was:
            return getattr(obj, "__qualname__", None) or type(obj).__name__
    return None


class _Syncs:
    """Synchronisations torch reports while active (its sync debug mode, set to warn)."""

    def __enter__(self):
        self.found = []
        self.on = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self.on:
            self.old = torch.cuda.get_sync_debug_mode()
            self.ctx = warnings.catch_warnings(record=True)
            self.records = self.ctx.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(1)
        return self

    def seen(self):
        if not self.on:
            return []
        return ["%s:%d" % (w.filename.rsplit("/", 1)[-1], w.lineno) for w in self.records
                if "synchroniz" in str(w.message)]

    def __exit__(self, *exc):
        if self.on:
            torch.cuda.set_sync_debug_mode(self.old)
            self.found = self.seen()
            self.ctx.__exit__(*exc)


def probe(fn, args, kwargs, inputs):
    """(result of the eager call, Verdict). `inputs`: the call's graph inputs (keys.flatten's tensors)."""
    objects = objects_of((args, kwargs))
    before, writes = [], {}
    for o in objects:
        state, found = tokens.state_and_writes(o)
        before.append(state)
        writes.update(dict.fromkeys(found))
    given = rerun.Containers((args, kwargs))
    start = rng.Snapshot()

    def repeatable():   # compile-ahead may run the call again only where a second run changes nothing
        return not (watch.other_reads or syncs.seen() or waits.found or _changed(objects, before))

    with HostReads(inputs) as watch, _Syncs() as syncs, Waits(raise_=False) as waits:
        out = eager.eager_call(fn, args, kwargs, repeatable=repeatable)
    if watch.other_reads:
        method, where = watch.other_reads[0]
        return out, Verdict("reads a GPU value on the host (%s at %s)" % (method, where))
    if syncs.found or waits.found:
        return out, Verdict("waits for the GPU inside the step (%s)" % (waits.found or syncs.found)[0])
    changed = _changed(objects, before)
    if changed is not None:
        return out, Verdict("changes Python state between calls (%s)" % changed)
    moved = rng.Snapshot()
    if not (moved.host_draws_since(start) or moved.cuda_draws_since(start)):
        return out, Verdict(input_reads=watch.input_reads, writes=writes)
    out, depends = _once_from(start, given, fn, args, kwargs, host=moved.host_draws_since(start))
    if depends:
        return out, Verdict("draws host random numbers that change its result")
    return out, Verdict(input_reads=watch.input_reads, writes=writes,
                        note="draws random numbers that a replay reproduces" if not moved.host_draws_since(start)
                        else "draws host random numbers that do not change its result")


def _once_from(start, given, fn, args, kwargs, host):
    """The call once more from the generator states it started with (compile-ahead may have run it several
    times, each drawing again): its result and the generators are then exactly what one stock call gives. With
    host draws, also whether the result depends on them: a run from other host states is compared."""
    k0 = kernel_report.snapshot()
    start.restore()
    given.restore()
    out = fn(*args, **kwargs)
    once = rng.Snapshot()
    depends = False
    if host:
        try:
            start.restore()
            given.restore()
            rng.perturb_host()
            depends = not _equal(out, fn(*args, **kwargs))
        finally:
            once.restore()
    kernel_report.rollback(k0)
    return out, depends


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b
