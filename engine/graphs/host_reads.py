"""Reads of tensor values on the host (`.item()`, `bool(t)`, `float(t)`, `.tolist()`, ...) inside a step.

A graph replays GPU work only: Python that looked at a GPU value while the graph was captured decided once,
for that value. So a step that reads GPU values on the host can be captured only where the value it read is a
graph input the host can read itself before each replay (Kohya Deep Shrink reads `transformer_options
["sigmas"][0].item()`, a view of the step's timestep): such a step is captured per input value, and inside
the capture the read is answered from the host copy instead of waiting for the GPU (which a capture forbids).
A read of a value computed inside the step (EasyCache's `(t[0] > end).item()`) cannot be: that step is refused.

`HostReads(inputs)` intercepts those tensor methods on the current thread while it is active (other threads
go straight to torch) and records which inputs were read and where other GPU values were read.
"""
import contextlib
import os
import sys
import threading

import torch

_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")
_tls = threading.local()
_install_lock = threading.Lock()
_installed = [0, {}, set()]   # scopes active in any thread, the original methods, those torch.Tensor defines
_HERE = os.path.dirname(os.path.abspath(__file__))
WATCHED = "cuda"     # the device whose values a read waits for (tests on the CPU watch "cpu")


def _dispatch(name):
    def read(t, *args, **kwargs):
        watch = getattr(_tls, "watch", None)
        original = _installed[1][name]
        if watch is None or watch.busy:
            return original(t, *args, **kwargs)
        return watch.read(name, original, t, args, kwargs)
    read.__name__ = name
    return read


def _install():
    with _install_lock:
        if _installed[0] == 0:
            for name in _METHODS:
                _installed[1][name] = getattr(torch.Tensor, name)
                if name in torch.Tensor.__dict__:
                    _installed[2].add(name)
                setattr(torch.Tensor, name, _dispatch(name))
        _installed[0] += 1


def _uninstall():
    with _install_lock:
        _installed[0] -= 1
        if _installed[0] == 0:
            for name, fn in _installed[1].items():
                if name in _installed[2]:
                    setattr(torch.Tensor, name, fn)
                else:
                    delattr(torch.Tensor, name)     # inherited from torch's C base class: visible again
            _installed[2].clear()


def caller():
    """'file:line (function)' of the innermost frame outside torch and this package: who read the value."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if not (path.startswith(_HERE) or os.sep + "torch" + os.sep in path):
            return "%s:%d (%s)" % (os.path.basename(path), f.f_lineno, f.f_code.co_name)
        f = f.f_back
    return "unknown"


class HostReads:
    """See the module doc. `host_values` ({input index: CPU copy}) answers reads of inputs (inside a capture)."""

    def __init__(self, inputs, host_values=None):
        self.inputs = inputs
        self.host_values = host_values
        self.by_storage = {}
        for i, t in enumerate(inputs):
            if t.device.type == WATCHED and t.is_contiguous():
                # one tensor can be several inputs (ComfyUI passes the timestep as `t` and as
                # transformer_options["sigmas"]): a capture gives each its own buffer, so each gets the value
                self.by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(i)
        self.input_reads = set()
        self.other_reads = []         # (method, caller) of GPU values that are no inputs
        self.busy = False

    def __enter__(self):
        self.outer = getattr(_tls, "watch", None)
        _install()
        _tls.watch = self
        return self

    def __exit__(self, *exc):
        _tls.watch = self.outer
        _uninstall()

    def read(self, name, original, t, args, kwargs):
        if t.device.type != WATCHED:
            return original(t, *args, **kwargs)
        found = self.by_storage.get(t.untyped_storage().data_ptr())
        if found is None:
            self.other_reads.append((name, caller()))
            return original(t, *args, **kwargs)
        self.input_reads.update(found)
        i = found[0]
        self.busy = True
        try:
            if self.host_values is not None:
                if i not in self.host_values:
                    raise RuntimeError("a host read of graph input %d that the probe did not see" % i)
                return original(self._host_view(t, i), *args, **kwargs)
            with sync_checks_off():
                return original(t, *args, **kwargs)
        finally:
            self.busy = False

    def _host_view(self, t, i):
        base, host = self.inputs[i], self.host_values[i]
        offset = t.storage_offset() - base.storage_offset()
        return torch.as_strided(host, t.shape, t.stride(), host.storage_offset() + offset)


@contextlib.contextmanager
def sync_checks_off():
    """No synchronisation warnings or errors inside (a read the caller has accounted for)."""
    if not torch.cuda.is_available():
        yield
        return
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)
