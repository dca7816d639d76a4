"""Derived copies of weights (FP8 e4m3 with per-channel scales; fp16 upcasts of fp8-stored weights), made once
per weight and never stale.

A copy is keyed on the weight tensor itself, as engine/graphs/fingerprint.py keys graphs: its identity (a weak
reference, never an `id()`, which a new tensor can reuse), its storage address, its version counter (bumped
by an in-place write; inference tensors have none) and the host's patch state of the current step (ComfyUI's
`current_weight_patches_uuid`, which changes when a LoRA is patched in place into an inference tensor). A LoRA
or weight patch replaces the Parameter or writes into it, so the next call finds no valid copy and makes a new
one from the patched weight. A copy dies with its weight, and `drop_off_device` frees the copies of weights
that left the GPU (a model unloaded or offloaded), so derived copies never hold VRAM for a model not there.

The copies are real VRAM: `bytes_on(device)` is counted in the run report.
"""
import threading
import weakref

import torch

from ...kernels.quantize_rows import quantize_weight_per_channel
from ..tensor_version import version_of

FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))

_lock = threading.Lock()
_copies = {}            # (kind, id(weight)) -> _Entry
_state = threading.local()


class _Entry:
    __slots__ = ("ref", "ptr", "version", "host_state", "value", "nbytes", "device")

    def valid_for(self, w, host_state):
        return (self.ref() is w and self.ptr == w.data_ptr() and self.version == version_of(w)
                and self.host_state == host_state)


class host_state:
    """`with host_state(value):` the host's weight-patch state for the calls inside (per thread)."""

    def __init__(self, value):
        self.value = value

    def __enter__(self):
        self.prev = getattr(_state, "value", None)
        _state.value = self.value

    def __exit__(self, *exc):
        _state.value = self.prev


def _current_host_state():
    return getattr(_state, "value", None)


class CopyInsideCapture(RuntimeError):
    """A derived copy asked for inside a CUDA graph capture: made there, it would live in the graph's memory (only
    valid once replayed, and freed under the graph when replaced). The capture fails cleanly instead; the host
    runs a key's first step after a weight change eagerly (StepGraphs' `warm_after_change`) so this stays a
    safety net."""


def _derived(kind, w, make):
    key = (kind, id(w))
    hs = _current_host_state()
    entry = _copies.get(key)
    if entry is not None and entry.valid_for(w, hs):
        return entry.value
    if w.is_cuda and torch.cuda.is_current_stream_capturing():
        raise CopyInsideCapture("a %s copy of a %s weight made inside a capture" % (kind, tuple(w.shape)))
    with torch.no_grad():
        value = make(w)
    entry = _Entry()
    entry.ref = weakref.ref(w, lambda _r, key=key: _forget(key))
    entry.ptr, entry.version, entry.host_state, entry.value = w.data_ptr(), version_of(w), hs, value
    entry.nbytes = sum(t.numel() * t.element_size() for t in value)
    entry.device = w.device
    with _lock:
        _copies[key] = entry
    return value


def _forget(key):
    with _lock:
        _copies.pop(key, None)


def fp8_of(w):
    """(q float8_e4m3fn [N, K] contiguous, scale fp32 [1, N]) of weight `w` [N, K] (per output channel)."""
    return _derived("fp8", w, lambda t: quantize_weight_per_channel(t.detach()))


def fp8_stored(w, scale_weight=None):
    """(w [N, K], scale fp32 [1, N]) of a weight already stored as float8_e4m3fn (an fp8 checkpoint): used as it
    is, with its checkpoint's `scale_weight` (one scale, or one per channel) or 1."""
    def make(t):
        s = torch.ones((), device=t.device) if scale_weight is None else scale_weight.detach().float()
        return t.detach().reshape(t.shape[0], -1).contiguous(), s.expand(1, t.shape[0]).contiguous()
    return _derived("fp8_stored", w, make)


_UPCAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)   # the compute dtypes a host casts fp8 weights to


def upcast_of(w, dtype):
    """(`w` cast to `dtype`,) kept, layout kept (channels_last stays channels_last): what ComfyUI's manual cast
    computes on every call for an fp8-stored weight, computed once."""
    return _derived(("upcast", dtype), w, lambda t: (t.detach().to(dtype),))


def host_casts_dtype_only(m, x):
    """Whether the host casts host module `m`'s weights for input `x` only to change their dtype: nothing patched
    per call (`weight_function`, `bias_function`: LoRA on a low-VRAM model), no checkpoint scale, the weight and
    bias on x's device. Only then may a cast of our own stand in for the host's."""
    w, b = m.weight, m.bias
    return not (getattr(m, "weight_function", None) or getattr(m, "bias_function", None) or w is None
                or getattr(m, "scale_weight", None) is not None or w.device != x.device
                or (b is not None and b.device != x.device))


def kept_upcast(m, x):
    """(weight, bias) of host module `m` in x's dtype from kept copies (`upcast_of`) where `host_casts_dtype_only`,
    else None: the host's cast must run."""
    if not host_casts_dtype_only(m, x):
        return None
    w, b = m.weight, m.bias
    if w.dtype != x.dtype:
        w = upcast_of(w, x.dtype)[0]
    if b is not None and b.dtype != x.dtype:
        b = upcast_of(b, x.dtype)[0]
    return w, b


def upcast_copies_of(w):
    """The kept fp16 copies (`upcast_of`) of weight `w`: a conv weight's layout change (channels_last for the
    graphs, back to stock's after a run) must reach them too, or convolutions over them run in the other layout
    than their activations (cuDNN then transforms the weight at every call)."""
    with _lock:
        entries = [_copies.get((("upcast", dtype), id(w))) for dtype in _UPCAST_DTYPES]
    return [t for e in entries if e is not None and e.ref() is w for t in e.value]


def bytes_on(device=None):
    """VRAM held by the derived copies (on `device`, or all)."""
    with _lock:
        return sum(e.nbytes for e in _copies.values() if device is None or e.device == torch.device(device))


def drop_copies_of(tensors):
    """Frees every derived copy of `tensors` (a mode that used them turned off while the weights stay)."""
    ids = {id(t) for t in tensors}
    with _lock:
        for k in [k for k, e in _copies.items() if k[1] in ids and e.ref() is not None and id(e.ref()) in ids]:
            del _copies[k]


def drop_off_device():
    """Frees the copies whose weight is gone or no longer on the copy's device."""
    with _lock:
        stale = [k for k, e in _copies.items() if e.ref() is None or e.ref().device != e.device]
        for k in stale:
            del _copies[k]
    return len(stale)
