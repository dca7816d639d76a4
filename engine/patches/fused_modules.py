"""Drop-in replacement modules that run the fused kernels.

Each replacement is an instance of a subclass of the module it replaces (so `isinstance` checks by
other packs still hold), with its own copy of the parameter/buffer/submodule dicts holding the SAME
Parameter objects: parameter names (`weight`, `bias`, `proj.weight`) are unchanged, so LoRA and
weight patches find them, and moving the model between devices moves the shared tensors. The
original module is not kept inside the replacement; the host keeps it for undoing.

Weights are read through `weights_of`, which defers to the host's own casting when the host has marked
the module for it (ComfyUI's low-VRAM and manual-cast modes set `comfy_cast_weights` or
`weight_function`), so offloaded and low-precision weights keep working.
"""
import functools
import inspect

import torch.nn.functional as F
from torch import nn

from ...kernels.geglu import geglu
from ...kernels.group_norm_silu import group_norm_silu
from ...kernels.layer_norm import layer_norm
from ..reports import kernel_report
from . import stock_path

_host_cast = None   # host hook: fn(module, input) -> (weight, bias), set by the host adapter


def set_host_weight_caster(fn):
    """Register the host's cast-on-the-fly function (ComfyUI: comfy.ops.cast_bias_weight)."""
    global _host_cast
    _host_cast = fn


def _needs_host_cast(m):
    # ComfyUI 2024 uses None/callable for weight_function, current ComfyUI a list: truthiness covers both
    return bool(getattr(m, "comfy_cast_weights", False) or getattr(m, "weight_function", None)
                or getattr(m, "bias_function", None))


def weights_of(m, x):
    if _host_cast is not None and _needs_host_cast(m):
        return _host_cast(m, x)
    return m.weight, m.bias


class FusedGroupNorm:
    """GroupNorm (+ the SiLU that followed it in its Sequential, when `sdaccel_act == "silu"`)."""
    sdaccel_kind = "group_norm"

    def forward(self, x):
        if stock_path.active() or host_replaced(self):
            out = original_class(self).forward(self, x)
            return F.silu(out) if self.sdaccel_act == "silu" else out
        w, b = weights_of(self, x)
        out = group_norm_silu(x, self.num_groups, w, b, self.eps, activation=self.sdaccel_act)
        kernel_report.record("group_norm_silu" if self.sdaccel_act else "group_norm", group_norm_silu.last_call)
        return out


class FusedLayerNorm:
    sdaccel_kind = "layer_norm"

    def forward(self, x):
        if stock_path.active() or host_replaced(self):
            return original_class(self).forward(self, x)
        w, b = weights_of(self, x) if self.weight is not None else (None, None)
        out = layer_norm(x, self.normalized_shape, w, b, self.eps)
        kernel_report.record("layer_norm", layer_norm.last_call)
        return out


class FusedGEGLU:
    """`a, gate = proj(x).chunk(2, -1); a * gelu(gate)` with the chunk, GELU and product fused.
    `proj` stays the host's own Linear module (it does its own casting and LoRA patching)."""
    sdaccel_kind = "geglu"

    def forward(self, x):
        if stock_path.active() or host_replaced(self):
            return original_class(self).forward(self, x)
        h = self.proj(x)
        out = geglu(h)
        kernel_report.record("geglu", geglu.last_call)
        return out


_class_cache = {}


def _fused_class(mixin, base):
    key = (mixin, base)
    if key not in _class_cache:
        _class_cache[key] = type("SDAccel%s" % base.__name__, (mixin, base),
                                 {"__module__": __name__, "_sdaccel_host_impl": _host_impl(base)})
    return _class_cache[key]


_HOST_METHODS = ("forward", "forward_comfy_cast_weights", "_forward")


def _host_impl(base):
    """(class, method name, function) of every forward the host class's MRO defines, as they are now."""
    return tuple((c, name, c.__dict__[name]) for c in base.__mro__ for name in _HOST_METHODS if name in c.__dict__)


def host_replaced(m):
    """True when another pack has replaced a forward of `m`'s host class since the stand-in class was made
    (AnimateDiff v1 swaps GroupNorm's forward for one that normalises across frames, for the UNet's call):
    the stand-in then runs the host's forward, whatever it is now, as stock would."""
    return any(c.__dict__.get(name) is not fn for c, name, fn in type(m)._sdaccel_host_impl)


def is_fused(m):
    return getattr(type(m), "sdaccel_kind", None) is not None


def original_class(m):
    """The host class a replacement stands in for (the module's own class if it is not ours)."""
    if not is_fused(m):
        return type(m)
    return type(m).__mro__[2]


def _clone_into(cls, orig):
    new = cls.__new__(cls)
    new.__dict__.update(orig.__dict__)
    # nn.Module keeps params/buffers/children/hooks in dicts: copy them so the replacement can be
    # patched (e.g. ComfyUI's set_attr_param) without touching the original module.
    # The children dict (`_modules`) stays shared: a stand-in with children (ResBlock, SpatialTransformer,
    # transformer block) has the original's children, and the host patches a child through the stand-in's
    # path. With a copy, a stand-in planned while an earlier one was applied would start from the earlier
    # patched children, and the host, restoring in its order, would leave a fused child on the original.
    for k, v in orig.__dict__.items():
        if isinstance(v, (dict, set)) and k != "_modules":
            new.__dict__[k] = v.copy()
    return new


@functools.lru_cache(maxsize=None)
def host_source(cls, method, params):
    """The source of `cls.<method>` when `cls` itself defines it with exactly these parameter names, else
    None. Stand-ins that re-implement a host method (a SpatialTransformer's forward, a ResBlock's
    _forward) check it for the steps they reproduce. Read once per class."""
    fn = cls.__dict__.get(method)
    if fn is None:
        return None
    try:
        if tuple(inspect.signature(fn).parameters) != tuple(params):
            return None
        return inspect.getsource(fn)
    except (TypeError, ValueError, OSError):
        return None


def clone_as(mixin, orig):
    """A replacement of `orig`: an instance of (mixin, orig's host class) sharing its tensors and children."""
    return _clone_into(_fused_class(mixin, original_class(orig)), orig)


def make_fused_group_norm(orig, act):
    cls = _fused_class(FusedGroupNorm, original_class(orig))
    new = _clone_into(cls, orig)
    new.sdaccel_act = act
    return new


def make_fused_layer_norm(orig):
    return _clone_into(_fused_class(FusedLayerNorm, original_class(orig)), orig)


def make_fused_geglu(orig):
    return _clone_into(_fused_class(FusedGEGLU, original_class(orig)), orig)


class SiLUFolded(nn.Identity):
    """Stands where an nn.SiLU was, once the SiLU is fused into the GroupNorm before it."""
    sdaccel_kind = "silu_folded"


def is_group_norm(m):
    return isinstance(m, nn.GroupNorm)


def is_layer_norm(m):
    return isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1


def is_geglu(m):
    # ComfyUI's and ldm's GEGLU: a `proj` Linear to 2*dim, then chunk/gelu/mul in forward
    return original_class(m).__name__ == "GEGLU" and isinstance(getattr(m, "proj", None), nn.Linear)


def is_silu(m):
    return isinstance(m, (nn.SiLU, SiLUFolded))


