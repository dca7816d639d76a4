"""Python calls that wait for the GPU (`torch.cuda.synchronize()`, a stream's or an event's `synchronize()`
or `query()`), watched on the current thread.

torch's sync debug mode covers the waits hidden inside tensor operations (`.item()`, `.cpu()`, `nonzero`);
these explicit ones it does not check, and inside a capture they are not refused by torch but invalidate the
capture in CUDA, which under cudaMallocAsync cannot be repaired in-process. So a probe records them as waits
(`Waits(raise_=False)`), and a capture raises at the call instead (`Waits(raise_=True)`), before CUDA sees it,
so the capture can still be ended cleanly.
"""
import threading

import torch

from .host_reads import caller

_tls = threading.local()
_lock = threading.Lock()
_state = {"depth": 0, "saved": []}


class CaptureForbidden(RuntimeError):
    """A wait for the GPU inside a capture (raised before it reaches CUDA)."""


def _targets():
    return [(torch.cuda, "synchronize", "torch.cuda.synchronize"),
            (torch.cuda.Stream, "synchronize", "Stream.synchronize"), (torch.cuda.Stream, "query", "Stream.query"),
            (torch.cuda.Event, "synchronize", "Event.synchronize"), (torch.cuda.Event, "query", "Event.query")]


def _guard(original, label):
    def guarded(*args, **kwargs):
        watch = getattr(_tls, "watch", None)
        if watch is not None:
            where = caller()
            watch.found.append("%s at %s" % (label, where))
            if watch.raise_:
                raise CaptureForbidden("%s inside a CUDA graph capture (%s)" % (label, where))
        return original(*args, **kwargs)
    guarded.sd_accel_original = original
    return guarded


def _install():
    with _lock:
        if _state["depth"] == 0:
            for owner, name, label in _targets():
                original = getattr(owner, name)
                _state["saved"].append((owner, name, original))
                setattr(owner, name, _guard(original, label))
        _state["depth"] += 1


def _uninstall():
    with _lock:
        _state["depth"] -= 1
        if _state["depth"] == 0:
            for owner, name, original in reversed(_state["saved"]):
                setattr(owner, name, original)
            _state["saved"].clear()


class Waits:
    def __init__(self, raise_):
        self.raise_ = raise_
        self.found = []

    def __enter__(self):
        self.outer = getattr(_tls, "watch", None)
        _install()
        _tls.watch = self
        return self

    def __exit__(self, *exc):
        _tls.watch = self.outer
        _uninstall()
