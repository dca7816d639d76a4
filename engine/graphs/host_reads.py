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

import torch

from .interception import Interception, Watch

_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")
_HERE = os.path.dirname(os.path.abspath(__file__))
WATCHED = "cuda"     # the device whose values a read waits for (tests on the CPU watch "cpu")


def _reader(interception, owner, name, original):
    def read(t, *args, **kwargs):
        watch = interception.current()
        if watch is None or watch.busy:
            return original(t, *args, **kwargs)
        return watch.read(name, original, t, args, kwargs)
    read.__name__ = name
    return read


_INTERCEPTION = Interception(lambda: [(torch.Tensor, name) for name in _METHODS], _reader)


def caller():
    """'file:line (function)' of the innermost frame outside torch and this package: who read the value."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if not (path.startswith(_HERE) or os.sep + "torch" + os.sep in path):
            return "%s:%d (%s)" % (os.path.basename(path), f.f_lineno, f.f_code.co_name)
        f = f.f_back
    return "unknown"


class HostReads(Watch):
    """See the module doc. `host_values` ({input index: CPU copy}) answers reads of inputs (inside a capture)."""
    interception = _INTERCEPTION

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
            with sync_debug(0):       # a read the watch accounts for
                return original(t, *args, **kwargs)
        finally:
            self.busy = False

    def _host_view(self, t, i):
        base, host = self.inputs[i], self.host_values[i]
        offset = t.storage_offset() - base.storage_offset()
        return torch.as_strided(host, t.shape, t.stride(), host.storage_offset() + offset)


@contextlib.contextmanager
def sync_debug(mode):
    """torch's sync debug mode inside the scope (0 off, 1 warn, 2 error), restored after; no-op without CUDA."""
    if not torch.cuda.is_available():
        yield
        return
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)
