"""Host copies of a model's weights that outlive its trips to the GPU. Host-agnostic (no ComfyUI import).

Under a VRAM budget the models take turns on the GPU every prompt: the text encoders for the prompt, the
UNet's share for sampling, the VAE for the decode. The host moves a model off the GPU with `Module.to(cpu)`,
which copies every weight into new pageable host memory, and back from there at pageable speed (device run
31, SDXL at 4 GiB: the text encoders' 1.6 GiB copied out took 147 ms inside the sampling call, and 283 ms to
come back before it).

A mirrored module keeps, for each parameter, the host tensor it last had: the first trip off the GPU copies
into pinned memory (pageable where pinning is unavailable) and the parameter keeps pointing there; the host's
next `.to(cuda)` reads from pinned memory at full bandwidth; the next trip off points the parameter back at
its host copy without copying. That is only right when the GPU copy still holds what the host copy holds:
ComfyUI restores every weight patch (LoRA, merges, in place or by replacing the Parameter) before it moves a
model off, and a replaced Parameter is a new object, which the mirror does not know and copies afresh. A
weight changed in place on the GPU outside the host's patching would not be carried back.

Buffers are not mirrored (`Module.to` gives them new tensor objects every trip; they are small). Only the
module's own `.to` is intercepted (an instance attribute): `.cuda()`, `.cpu()` or a submodule's `.to` take
the ordinary path, which is slower but correct (the mirror of a moved parameter is then copied afresh).
"""
import weakref

import torch

from .pinned_memory import host_buffers, nbytes as _nbytes, view_as

_MIRRORS = weakref.WeakKeyDictionary()   # module -> HostMirror, while it is armed
_ALIVE = [0]                              # how many were armed at the last release_freed()


def _on_host(t):
    return t.device.type == "cpu"


class HostMirror:
    def __init__(self, pin=True):
        self.pin = pin
        self.copies = {}      # id(Parameter) -> (weakref to it, its host tensor)
        self.stats = {"reused": 0, "reused_bytes": 0, "copied": 0, "copied_bytes": 0}

    def _valid(self, p):
        rec = self.copies.get(id(p))
        if rec is None or rec[0]() is not p:
            return None
        host = rec[1]
        return host if host.shape == p.shape and host.dtype == p.dtype else None

    def offload(self, module, on_host=None):
        """Points every parameter of `module` that is off the host at its host copy (made now, pinned, for
        the ones without a valid one). Returns the bytes copied. `on_host(tensor)`: where a tensor is (tests
        on a machine without a GPU say which host tensors stand for device ones).

        The copies made together are packed into pinned slabs (engine/memory/pinned_memory.py) group by group, a
        group being the parameters under one numbered child (`input_blocks.4`, `encoder.layers.7`): a slab
        is freed only once all its copies are, and a lowvram streamer that takes over a block's copies
        (`adopt`) takes over whole groups."""
        on_host = on_host or _on_host
        groups, seen = {}, set()
        with torch.no_grad():
            for mname, m in module.named_modules():
                for pname, p in m._parameters.items():
                    if p is None or id(p) in seen or on_host(p):
                        continue
                    seen.add(id(p))
                    host = self._valid(p)
                    if host is not None:
                        p.data = host
                        self.stats["reused"] += 1
                        self.stats["reused_bytes"] += _nbytes(host)
                    else:
                        groups.setdefault(_group_of(mname + "." + pname), []).append(p)
            copied = 0
            for fresh in groups.values():
                for p, buf in zip(fresh, host_buffers([_nbytes(p) for p in fresh], self.pin)):
                    host = view_as(buf, 0, p)
                    host.copy_(p.data)
                    p.data = host
                    self.copies[id(p)] = (weakref.ref(p), host)
                    self.stats["copied"] += 1
                    self.stats["copied_bytes"] += _nbytes(host)
                    copied += _nbytes(host)
        self._forget_dead()
        return copied

    def _forget_dead(self):
        dead = [k for k, (ref, _) in self.copies.items() if ref() is None]
        for k in dead:
            del self.copies[k]

    def host_bytes(self):
        return sum(_nbytes(h) for _, h in self.copies.values())


def _group_of(name):
    """A parameter's packing group: its path up to the first numbered component (`input_blocks.4.1.proj_in
    .weight` -> `input_blocks.4`), or its module's path where none is numbered."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1])


def _to_host_target(args, kwargs):
    """True when a Module.to(...) call moves to the host (device 'cpu' given, positionally or by keyword)."""
    dev = kwargs.get("device")
    if dev is None and args:
        a = args[0]
        if isinstance(a, (str, torch.device)):
            dev = a
    if dev is None:
        return False
    try:
        return torch.device(dev).type == "cpu"
    except (RuntimeError, TypeError):
        return False


def arm(module, pin=True):
    """Mirrors `module` (idempotent): its own `.to(cpu)` from now on goes through the mirror. Returns it."""
    mirror = _MIRRORS.get(module)
    if mirror is not None:
        return mirror
    mirror = HostMirror(pin=pin and torch.cuda.is_available())
    ref = weakref.ref(module)

    def to(*args, **kwargs):     # the instance's own .to, the class's after the mirror moved what it knows
        mod = ref()
        if _to_host_target(args, kwargs):
            mirror.offload(mod)
        return type(mod).to(mod, *args, **kwargs)

    to.sd_accel_host_mirror = mirror
    module.__dict__["to"] = to
    _MIRRORS[module] = mirror
    _ALIVE[0] = len(_MIRRORS)
    return mirror


def disarm(module):
    """Removes the interception; the parameters keep whatever they point at now. Idempotent."""
    f = module.__dict__.get("to")
    if f is not None and getattr(f, "sd_accel_host_mirror", None) is not None:
        del module.__dict__["to"]
    _MIRRORS.pop(module, None)
    _ALIVE[0] = len(_MIRRORS)


def release_freed():
    """Once a mirrored module was freed (the user switched checkpoints), its pinned copies went back to torch's
    pinned-memory cache, which keeps them from the OS: empties that cache. Cheap when nothing was freed."""
    alive = len(_MIRRORS)
    freed = alive < _ALIVE[0]
    _ALIVE[0] = alive
    empty = getattr(torch._C, "_host_emptyCache", None)
    if freed and empty is not None and torch.cuda.is_available():
        empty()
    return freed


def adopt(param, old_host, new_host):
    """`param`'s host data moved from `old_host` to `new_host` (equal values: a lowvram streamer's buffer): a
    mirror whose copy of `param` is `old_host` keeps `new_host` instead, so both are not held (its slab is
    freed once every copy in it is adopted or dead). A mirror holding anything else for it is left alone."""
    for mirror in list(_MIRRORS.values()):
        rec = mirror.copies.get(id(param))
        if rec is not None and rec[0]() is param and rec[1].data_ptr() == old_host.data_ptr():
            mirror.copies[id(param)] = (rec[0], new_host)


def mirror_of(module):
    return _MIRRORS.get(module)
