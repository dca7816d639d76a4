"""Reuse a ControlNet's `input_hint_block` output across the steps of one sampling run (lossless).

A cldm ControlNet runs `input_hint_block(hint, emb, context)` on every step: a stack of convs + SiLU at
full image resolution whose output depends only on the hint image (not on the timestep, `emb`, or
`context`). The hint tensor ComfyUI passes stays the same object for a whole sampling run, so the
block's output can be computed on the first step and reused on the next ones.

`plan_hint_cache(root, prefix)` returns `{path: replacement}` like `patching.plan_patches`: the
replacement is an instance of the block's own class (`TimestepEmbedSequential`, fused_modules.clone_as) holding
the SAME child modules, so parameter names (`input_hint_block.0.weight`, ...) and weight patching are
unchanged; the host applies and removes it (ComfyUI: `add_object_patch`). Only blocks made of
timestep-free layers (convolutions, SiLU, identity, fused replacements of those) are planned.

A cached output is reused only when all of these are unchanged since it was computed:
  * the hint tensor: the same memory (its storage is held, so the memory cannot be freed and given to
    another tensor), pointer, shape, stride, dtype, device and version counter (when it has one: inference
    tensors do not). Keying by storage rather than by tensor object matters for ControlNet Union, whose
    forward hands the block a new view of the same hint at every step (`hint.unsqueeze(0)[0]`; under
    inference mode such a view does not even record its base). A write through any view of a normal
    tensor bumps the version counter they share;
  * every weight of the block: identity, storage pointer, version counter where available, and the
    host's per-module weight functions (ComfyUI's low-VRAM LoRA patches);
  * the call itself: no `transformer_options` patches, autograd off or nothing requiring grad.
Up to `MAX_ENTRIES` hints are kept (cond and uncond run apart with a batched hint); `clear()` drops
them, which the host does at the end of each sampling run so no activation outlives it.
"""
from collections import OrderedDict

import torch
from torch import nn

from . import fused_modules as fm
from ..tensor_version import version_of

MAX_ENTRIES = 2
HINT_BLOCK_NAMES = ("input_hint_block",)


def _tensor_key(t):
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, version_of(t))


def _memory_of(x):
    """(what to hold, slot): the storage behind `x` and where `x` lies in it; the tensor itself where it has
    no plain storage (a subclass, an empty tensor)."""
    try:
        storage = x.untyped_storage()
        if storage.nbytes() > 0:
            return storage, (storage.data_ptr(), x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, x.device)
    except (RuntimeError, NotImplementedError, TypeError):
        pass
    return x, (id(x),)


class HintBlockCache:
    """Mixin over the hint block's class: `forward` returns the stored output for an unchanged hint."""
    sdaccel_kind = "hint_cache"

    def sdaccel_reset(self):
        self.__dict__["_sdaccel_entries"] = OrderedDict()
        self.__dict__["_sdaccel_stats"] = {"hits": 0, "misses": 0, "bypassed": 0}

    def sdaccel_stats(self):
        return dict(self.__dict__["_sdaccel_stats"])

    def clear(self):
        self.__dict__["_sdaccel_entries"].clear()

    def _sdaccel_weights_key(self):
        key = []
        for m in self.modules():
            for name, p in m._parameters.items():
                if p is not None:
                    key.append((name, id(p), _tensor_key(p)))
            for attr in ("weight_function", "bias_function"):
                f = getattr(m, attr, None)
                if f:
                    key.append((attr,) + tuple(id(x) for x in (f if isinstance(f, (list, tuple)) else [f])))
        return tuple(key)

    def _sdaccel_cacheable(self, args, kwargs):
        to = kwargs.get("transformer_options")
        if to is None and len(args) > 2:
            to = args[2]
        if isinstance(to, dict) and to.get("patches"):
            return False   # another pack patches the block's layers for this call: do not second-guess it
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            return False
        return True

    def forward(self, x, *args, **kwargs):
        stats = self.__dict__["_sdaccel_stats"]
        if not isinstance(x, torch.Tensor) or not self._sdaccel_cacheable(args, kwargs):
            stats["bypassed"] += 1
            return fm.original_class(self).forward(self, x, *args, **kwargs)
        entries = self.__dict__["_sdaccel_entries"]
        held, slot = _memory_of(x)
        key = (_tensor_key(x), self._sdaccel_weights_key())
        hit = entries.get(slot)
        if hit is not None and hit[1] == key:   # the held memory (or tensor) makes the slot unique to it
            entries.move_to_end(slot)
            stats["hits"] += 1
            return hit[2]
        out = fm.original_class(self).forward(self, x, *args, **kwargs)
        entries[slot] = (held, key, out)
        entries.move_to_end(slot)
        while len(entries) > MAX_ENTRIES:
            entries.popitem(last=False)
        stats["misses"] += 1
        return out


def is_timestep_free(block):
    """True when every layer of `block` ignores the timestep embedding and the context."""
    children = list(block.children())
    if not children:
        return False
    for m in children:
        if fm.kind_of(m) == "silu_folded":
            continue
        if not isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.SiLU, nn.Identity)):
            return False
    return True


def make_hint_cache(orig):
    """The caching stand-in for `orig` (or for the host block behind an existing stand-in)."""
    new = fm.clone_as(HintBlockCache, orig)
    new.sdaccel_reset()
    return new


def plan_hint_cache(root, prefix=""):
    """{prefix + path: caching replacement} for the hint blocks of `root` that can be cached."""
    out = {}
    for name in HINT_BLOCK_NAMES:
        block = getattr(root, name, None)
        if isinstance(block, nn.Sequential) and is_timestep_free(block):
            out[prefix + name] = make_hint_cache(block)
    return out


def caches_in(modules):
    """The hint caches among `modules` (e.g. a plan's values)."""
    return [m for m in modules if fm.kind_of(m) == HintBlockCache.sdaccel_kind]
