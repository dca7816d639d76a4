"""Python calls that wait for the GPU (`torch.cuda.synchronize()`, a stream's or an event's `synchronize()`
or `query()`), watched on the current thread.

torch's sync debug mode covers the waits hidden inside tensor operations (`.item()`, `.cpu()`, `nonzero`);
these explicit ones it does not check, and inside a capture they are not refused by torch but invalidate the
capture in CUDA, which under cudaMallocAsync cannot be repaired in-process. So a probe records them as waits
(`Waits(raise_=False)`), and a capture raises at the call instead (`Waits(raise_=True)`), before CUDA sees it,
so the capture can still be ended cleanly.
"""
import torch

from .host_reads import caller
from .interception import Interception, Watch


class CaptureForbidden(RuntimeError):
    """A wait for the GPU inside a capture (raised before it reaches CUDA)."""


def _targets():
    return [(torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda.Stream, "query"),
            (torch.cuda.Event, "synchronize"), (torch.cuda.Event, "query")]


def _guard(interception, owner, name, original):
    label = "torch.cuda.%s" % name if owner is torch.cuda else "%s.%s" % (owner.__name__, name)

    def guarded(*args, **kwargs):
        watch = interception.current()
        if watch is not None:
            where = caller()
            watch.found.append("%s at %s" % (label, where))
            if watch.raise_:
                raise CaptureForbidden("%s inside a CUDA graph capture (%s)" % (label, where))
        return original(*args, **kwargs)
    return guarded


_INTERCEPTION = Interception(_targets, _guard)


class Waits(Watch):
    interception = _INTERCEPTION

    def __init__(self, raise_):
        self.raise_ = raise_
        self.found = []
