"""A step's call as a graph key plus the tensors that become the graph's inputs.

`flatten((args, kwargs))` walks the call: every GPU tensor is an input (copied into a static buffer before
each replay) and enters the key by shape, dtype, strides and device; dicts, lists and tuples enter by
structure; numbers and strings by value; any other object by `tokens.signature` (identity and content).
Small CPU tensors (sigma schedules read by Python-side logic) enter by value; a large CPU tensor (a cond the
host moves to the GPU inside the call) becomes a GPU input. UUIDs enter by their pattern (which entries are
equal), not their values: ComfyUI gives every cond a fresh uuid per sampling run, and a step computes the
same with new ones; what a patch keeps per uuid lives in the patch's own state, which its signature reads.
The key starts with the process's GEMM and convolution switches (`numerics`).
`rebuild` puts the static buffers back where the tensors were. GPU tensors found inside objects (a patch's
closure, say) are the key's `soft` tensors (tokens.py).
"""
import uuid
from collections import namedtuple

import torch

from . import tokens

SMALL_HOST_TENSOR = 256   # CPU tensors up to this many elements are keyed by value


Flat = namedtuple("Flat", "tensors key soft")


class _Flat:
    def __init__(self):
        self.tensors, self.key, self.uuids, self.soft, self.modules = [], [], {}, [], set()

    def walk(self, obj):
        if isinstance(obj, torch.Tensor):
            self.tensor(obj)
        elif isinstance(obj, dict):
            self.key.append(("D", len(obj)))
            for k, v in obj.items():
                self.key.append(k if isinstance(k, (str, int)) else repr(k))
                self.walk(v)
        elif isinstance(obj, (list, tuple)):
            self.key.append(("L" if isinstance(obj, list) else "U", len(obj)))
            for v in obj:
                self.walk(v)
        elif isinstance(obj, uuid.UUID):
            self.key.append(("uuid", self.uuids.setdefault(obj, len(self.uuids))))
        elif isinstance(obj, tokens.Token):
            self.key.append(obj)
        else:
            self.key.append(tokens.signature(obj, self.soft, self.modules))

    def tensor(self, t):
        if t.is_cuda:
            self.tensors.append(t)
            self.key.append(("T", tuple(t.shape), t.dtype, t.stride(), t.device))
        elif t.numel() <= SMALL_HOST_TENSOR:
            self.key.append(("C", tuple(t.shape), t.dtype, tuple(t.reshape(-1).tolist())))
        else:
            self.tensors.append(t)
            self.key.append(("X", tuple(t.shape), t.dtype, t.stride(), t.device))


def numerics():
    """The process-wide switches that choose which GEMM, convolution and attention kernels a capture records: a replay
    keeps the kernels of its capture, so a switch flipped between runs (KJNodes' loaders set fp16 accumulation on or off
    per model they load; a pack that turns an SDPA backend off for a model it knows it fails on) must give another key,
    as stock's next call would run other kernels."""
    m, cuda = torch.backends.cuda.matmul, torch.backends.cuda
    return ("numerics", m.allow_tf32, m.allow_fp16_reduced_precision_reduction,
            getattr(m, "allow_bf16_reduced_precision_reduction", None), getattr(m, "allow_fp16_accumulation", None),
            torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic,
            torch.are_deterministic_algorithms_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),
            cuda.math_sdp_enabled(), _enabled(cuda, "cudnn_sdp_enabled"))


def _enabled(module, switch):
    """A switch this torch may not have (None then)."""
    read = getattr(module, switch, None)
    return read() if read is not None else None


def flatten(obj):
    """Flat(input tensors, hashable key, soft tensors) of `obj` (see the module doc), the key led by `numerics()`."""
    f = _Flat()
    f.key.append(numerics())
    f.walk(obj)
    return Flat(f.tensors, tuple(f.key), f.soft)


def rebuild(obj, it):
    """`obj` with each input tensor replaced by the next item of `it` (flatten's order)."""
    if isinstance(obj, torch.Tensor):
        return next(it) if obj.is_cuda or obj.numel() > SMALL_HOST_TENSOR else obj
    if isinstance(obj, dict):
        return {k: rebuild(v, it) for k, v in obj.items()}
    if isinstance(obj, list):
        return [rebuild(v, it) for v in obj]
    if isinstance(obj, tuple):
        return tuple(rebuild(v, it) for v in obj)
    return obj


def static_copy(t, device=None):
    s = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device or t.device)
    s.copy_(t)
    return s


def map_tensors(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def key_diff(a, b):
    """First differing positions of two keys, for the debug log when a new key appears."""
    diffs = [(i, x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return diffs[:3] if diffs or len(a) == len(b) else "length %d vs %d" % (len(a), len(b))


def soft_marks(soft):
    """What a replay checks of the soft tensors a capture read: each one's object and where its data is (a
    module's `.to()` moves a parameter's data and keeps the object)."""
    return [(t, t.data_ptr()) for t in soft]


def soft_changed(marks, soft):
    """Indices of the soft tensors that are not what the capture read (all of them if the count differs)."""
    if len(marks) != len(soft):
        return list(range(len(soft)))
    return [i for i, ((t, ptr), now) in enumerate(zip(marks, soft)) if t is not now or now.data_ptr() != ptr]
