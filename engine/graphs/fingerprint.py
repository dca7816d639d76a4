"""A cheap identity of a module's weights and module tree, read on every step: a graph never replays stale.

(identity, storage address, version counter, dtype) of every parameter and buffer, read through the owning
modules' dicts, so a replaced Parameter (ComfyUI patches a LoRA in by replacing it, or in place, which bumps
`_version`) is seen; plus the identity of every module in the tree, so an object patch (a swapped
`model_sampling`, another pack's module) is seen too. Identities are weak references, never `id()`s: an id
is reused once its object dies, so a new tensor at the old address could otherwise look like the old one.

Cost: walking the module tree and reading every slot is ~1 ms for SD1.5. So within one sampling run (the
caller's `epoch`) the tree is walked at the run's first step only (hosts swap modules when they load a model,
before that step), and a later step re-reads the slots only when a tensor object or a version counter changed:
a Parameter replaced mid-run or an in-place write to a tensor with a version counter (A1111's LoRA) is still
seen at once; a `.data` swap of the same Parameter mid-run, which no host does, is seen at the next run's first
step. Without an epoch (None) every read is full.

That per-step check compares the slots' objects by `id()` in one C-level pass: safe because every object of the
last full read is weakly referenced with a callback that marks the read stale when one dies, so while none has
died no other object can hold one of their ids.

The module's and the token module's train/eval modes are part of it too: a layer may compute otherwise in one
than the other (ComfyUI's fp8_ops Linear multiplies in FP8 only in eval mode), so a `.eval()` or `.train()` on the
model after a capture is a change a replay must not miss.

Weights a block streamer keeps in fixed GPU places (engine/memory/offload.py) change where the fingerprint cannot see
them: the module's residency token (engine/memory/residency.py) is part of the fingerprint.
"""
import weakref

from ..memory import residency
from ..tensor_version import version_of

_NO_EPOCH = object()


class _Read:
    """One full read within an epoch: what the next steps' check compares against."""
    __slots__ = ("ids", "versioned", "result", "dead")

    def __init__(self, ids, versioned, result, dead):
        self.ids, self.versioned, self.result, self.dead = ids, versioned, result, dead


def _marker(dead):
    # a weakref callback holding only the flag: one holding the fingerprint would make a reference cycle
    return lambda ref: dead.append(True)


class WeightsFingerprint:
    """The modules are referred to weakly: the fingerprint lives in state kept on the module it reads (a host's
    per-model graphs), and a strong reference back would keep a model the user dropped (its weights too) until
    a garbage collection."""

    def __init__(self, module, token_module=None):
        self._module = weakref.ref(module)
        self._token_module = self._module if token_module is None else weakref.ref(token_module)
        self.dicts, self.names = (), ()   # slot i: the tensor at names[i] of the module dict dicts[i]
        self.tree = ()
        self.epoch = _NO_EPOCH
        self._last = None     # this epoch's last full read (a _Read)

    @property
    def module(self):
        return self._module()

    @property
    def token_module(self):
        return self._token_module()

    def refresh(self):
        modules = list(self.module.modules())
        slots = [(d, name) for m in modules for d in (m._parameters, m._buffers) for name in d]
        self.dicts = tuple(d for d, _ in slots)
        self.names = tuple(name for _, name in slots)
        self.tree = tuple(weakref.ref(m) for m in modules)

    def tensors(self):
        """The slots' current objects (None for an empty slot), in one C-level pass."""
        return list(map(dict.get, self.dicts, self.names))

    def read(self, epoch=None):
        """(fingerprint, all weights on the GPU). Equal fingerprints: the same weights in the same places."""
        if epoch is None or epoch is not self.epoch:
            self.refresh()
            self.epoch = epoch
            self._last = None
        tensors = self.tensors()
        last = self._last
        token = residency.token_of(self.token_module)
        modes = (self.module.training, self.token_module.training)
        if (last is not None and not last.dead and last.result[0][2] is token and last.result[0][3] == modes
                and list(map(id, tensors)) == last.ids and all(version_of(tensors[i]) == v for i, v in last.versioned)):
            return last.result
        dead = []
        mark = _marker(dead)
        refs, out, versioned, all_cuda = [], [], [], True
        for i, t in enumerate(tensors):
            if t is None:
                refs.append(None)
                out.append(None)
                continue
            all_cuda = all_cuda and t.is_cuda
            # inference tensors (ComfyUI loads weights under inference_mode) have no version counter; for them
            # an in-place update is caught by the host's own patch state (StepGraphs' `host_state`)
            version = version_of(t)
            if version is None:
                version = 0
            else:
                versioned.append((i, version))
            refs.append(weakref.ref(t, mark))
            out.append((t.data_ptr(), version, t.dtype))
        result = (_Identity(self.tree + tuple(refs)), tuple(out), token, modes), all_cuda
        if epoch is not None:
            self._last = _Read(list(map(id, tensors)), versioned, result, dead)
        return result


def off_gpu(module, limit=3):
    """Names of (up to `limit`) parameters and buffers of `module` that are not on a GPU, for the diagnosis log."""
    out = []
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t is not None and not t.is_cuda:
            out.append("%s (%s)" % (name, t.device))
            if len(out) >= limit:
                break
    return out


class _Identity:
    """The objects of one read, by weak reference: equal to another read of the same live objects only."""
    __slots__ = ("refs",)

    def __init__(self, refs):
        self.refs = refs

    def __eq__(self, other):
        if not isinstance(other, _Identity) or len(self.refs) != len(other.refs):
            return False
        for a, b in zip(self.refs, other.refs):
            if a is None or b is None:
                if a is not b:
                    return False
                continue
            obj = a()
            if obj is None or obj is not b():
                return False
        return True

    def __hash__(self):
        return len(self.refs)
