"""fp8-stored weights kept as stored (the nodes' fp8_weights "as stored", or where the fp16 copies do not fit),
cast a group of layers at a time.

ComfyUI computes an fp8-stored Linear/Conv2d by casting its weight and bias to the input's dtype at every call:
two small kernels and a Python call per layer, several hundred per step, which left SD Accel's graphs of such a
model at about two thirds of the fp16 model's speed. Here the model's fp8-stored layers are split into groups
of adjacent layers (`plan_groups`: at most GROUP_BYTES of fp16 weights each, in the order the model registers
them, which is the order a UNet runs them). Inside a step (`step()`, entered by the host around each
accelerated step), the first call into a group casts all of its weights with one kernel
(kernels/upcast_fp8.py) into one buffer, and each layer computes with its view of it. The buffer is dropped
once every layer of the group has had its weights, or when the step ends: a step holds one or two groups'
fp16 weights at a time, not the model's. Inside a CUDA graph the casts are captured with the step, so each
replay casts again from the fp8 weights as they are (a LoRA written into them in place is seen).

The values are ComfyUI's: the fp8 -> fp16 cast is exact, and biases (a few KB a layer) are read from kept fp16
copies (engine/fp8/weights.upcast_of), the same values. A layer the host must cast itself (a weight computed per
call, a checkpoint scale, a weight not on the input's device) gets None and runs the host's forward; so does
any call outside a step.
"""
import contextlib
import threading
import weakref

import torch

from ...kernels import upcast_fp8 as kernel
from ..reports import kernel_report
from . import weights

GROUP_BYTES = 64 << 20    # fp16 bytes of one group's weights: its buffer's size, one or two alive at a time


class _Local(threading.local):
    live = None     # during a step: {group: _Cast}, the groups cast in it whose layers have not all been served


_LOCAL = _Local()


@contextlib.contextmanager
def step():
    """The scope of one accelerated step on this thread: groups cast inside it are dropped when it ends."""
    outer, _LOCAL.live = _LOCAL.live, {}
    try:
        yield
    finally:
        _LOCAL.live = outer


class _Cast:
    __slots__ = ("dtype", "device", "views", "served")


class UpcastGroup:
    """Adjacent fp8-stored layers whose weights are cast together (see the module's docstring)."""

    def __init__(self, modules):
        # weakly: each member's forward patch holds its group, so a strong reference would be a cycle that keeps
        # the layers, and their weights, until a garbage collection runs (see ForwardPatch)
        self._modules = tuple(weakref.ref(m) for m in modules)
        self._layouts = {}    # source sizes -> kernel.Layout
        # source addresses -> pointer table. Never dropped while the group lives: a graph captured over a table
        # reads it at every replay, and is replayed again whenever its weights are back (a LoRA taken off).
        # A few hundred bytes each.
        self._pointers = {}

    def weights(self, m, x):
        """(weight, bias) of member `m` in x's dtype, or None: the host's forward casts them."""
        live = _LOCAL.live
        if live is None:
            return None
        cast = live.get(self)
        if cast is None or id(m) in cast.served or cast.dtype != x.dtype or cast.device != x.device:
            cast = live[self] = self._cast(x)
        cast.served.add(id(m))
        if len(cast.served) == len(self._modules):
            del live[self]
        return cast.views.get(id(m))

    @property
    def modules(self):
        """The members still alive, in the model's order."""
        return tuple(m for m in (r() for r in self._modules) if m is not None)

    def _cast(self, x):
        members, sources = [], []
        for m in self.modules:
            if castable(m, x) and (not sources or m.weight.dtype == sources[0].dtype):
                members.append(m)
                sources.append(m.weight)
        cast = _Cast()
        cast.dtype, cast.device, cast.views, cast.served = x.dtype, x.device, {}, set()
        if not sources or kernel.sources_ineligible(sources):
            return cast
        layout, pointers = self._tables(sources, x.device)
        dst = torch.empty(layout.total, dtype=x.dtype, device=x.device)
        kernel.upcast_fp8(sources, dst, layout, pointers)
        kernel_report.record("fp8_upcast_group", kernel.upcast_fp8.last_call)
        for i, m in enumerate(members):
            b = m.bias
            if b is not None and b.dtype != x.dtype:
                b = weights.upcast_of(b, x.dtype)[0]
            cast.views[id(m)] = (layout.view(dst, i, m.weight), b)
        return cast

    def _tables(self, sources, device):
        sizes = tuple(t.numel() for t in sources)
        addresses = (device,) + tuple(t.data_ptr() for t in sources)
        layout, pointers = self._layouts.get((device, sizes)), self._pointers.get(addresses)
        if layout is None or pointers is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # a table made here would be a host-to-device copy inside the capture: the capture fails
                # cleanly; the host runs a step after each weight change outside any capture first
                raise weights.CopyInsideCapture("an upcast table for %d new fp8 weights inside a capture"
                                                % len(sources))
            if layout is None:
                layout = self._layouts[(device, sizes)] = kernel.Layout(sizes, device)
            if pointers is None:
                pointers = self._pointers[addresses] = kernel.pointer_table(sources, device)
        return layout, pointers


def castable(m, x):
    """Whether the group may cast `m`'s weight: an fp8 one the host would only change the dtype of."""
    return weights.host_casts_dtype_only(m, x) and m.weight.dtype in weights.FP8_DTYPES


def plan_groups(modules):
    """`modules` (fp8-stored layers, in the model's order) split into UpcastGroups of adjacent layers, each of at
    most GROUP_BYTES of fp16 weights (a larger layer alone)."""
    groups, run, size = [], [], 0
    for m in modules:
        nbytes = m.weight.numel() * 2
        if run and size + nbytes > GROUP_BYTES:
            groups.append(UpcastGroup(run))
            run, size = [], 0
        run.append(m)
        size += nbytes
    if run:
        groups.append(UpcastGroup(run))
    return groups
