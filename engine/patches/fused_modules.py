"""Drop-in replacement modules that run the fused kernels.

Each replacement is an instance of the very class of the module it replaces (so other packs' `isinstance`
and exact-class checks still hold) with SD Accel's methods set on the instance, sharing the original's
parameter, buffer and submodule dicts: parameter names (`weight`, `bias`, `proj.weight`) are unchanged, so LoRA
and weight patches find them, a patch made through either module is seen by both (as on stock), and moving the
model between devices moves the shared tensors. The original module is not kept inside the replacement; the
host keeps it for undoing.

Weights are read through `weights_of`, which defers to the host's own casting when the host has marked
the module for it (ComfyUI's low-VRAM and manual-cast modes set `comfy_cast_weights` or
`weight_function`), so offloaded and low-precision weights keep working.
"""
import functools
import inspect
import types

import torch.nn.functional as F
from torch import nn

from ...kernels.geglu import geglu
from ...kernels.group_norm_silu import group_norm_silu
from ...kernels.layer_norm import layer_norm
from ..fp8 import weights
from ..reports import kernel_report
from . import shared_state, stock_path

_host_cast = None   # host hook: fn(module, input) -> (weight, bias), set by the host adapter


def set_host_weight_caster(fn):
    """Register the host's cast-on-the-fly function (ComfyUI: comfy.ops.cast_bias_weight)."""
    global _host_cast
    _host_cast = fn


_plain_casts = set()   # host hook: the host's `forward_comfy_cast_weights` functions that compute the plain op
_plain_in_training = set()   # host hook: those that compute it only while their module is in training mode


def set_plain_cast_forwards(fns, in_training=()):
    """Register the host's own `forward_comfy_cast_weights` functions that compute the plain op (F.linear, the
    convolution, the norm) over the weights cast to the input's dtype (ComfyUI: its disable_weight_init classes',
    which manual_cast's inherit), and `in_training`: those that do so only in training mode (ComfyUI's fp8_ops
    Linear multiplies in FP8 in eval mode only)."""
    _plain_casts.update(fns)
    _plain_in_training.update(in_training)


def computes_plainly(m):
    """Whether host layer `m` computes the plain op over its weights as `weights_of` reads them: no checkpoint scale,
    and where its class has a `forward_comfy_cast_weights`, one the host registered as plain (a host that registers
    none has no other). ComfyUI's scaled-fp8 Linear multiplies its weight by `scale_weight`, and its fp8_ops Linear
    (UNETLoader's fp8_e4m3fn_fast, on a GPU with FP8 compute) multiplies in FP8 over the input cast to fp8: SD
    Accel computing such a layer from `weights_of` would compute another image than stock's, so it runs its own
    forward."""
    if getattr(m, "scale_weight", None) is not None or getattr(m, "scale_input", None) is not None:
        return False
    fn = getattr(type(m), "forward_comfy_cast_weights", None)
    return fn is None or not _plain_casts or fn in _plain_casts


def computes_plainly_in_training(m):
    """Whether host layer `m` is of a class that computes the plain op only while `m.training` is set. No fused
    module reads such a layer's weights (`computes_plainly` is False for it) but those that check the mode at each
    call: a forward patch (engine/fp8/upcast.py) and the shared timestep-embedding GEMM (emb_projections.py); graphs
    see a change of mode (engine/graphs/fingerprint.py)."""
    if getattr(m, "scale_weight", None) is not None or getattr(m, "scale_input", None) is not None:
        return False
    return getattr(type(m), "forward_comfy_cast_weights", None) in _plain_in_training


def _needs_host_cast(m):
    # ComfyUI 2024 uses None/callable for weight_function, current ComfyUI a list: truthiness covers both
    return bool(getattr(m, "comfy_cast_weights", False) or getattr(m, "weight_function", None)
                or getattr(m, "bias_function", None))


def weights_of(m, x):
    own = getattr(m.__dict__.get("forward"), "sdaccel_weights", None)   # a forward patch that keeps its own copy
    if own is not None:                                                  # (engine/fp8/upcast.py)
        wb = own(x)
        if wb is not None:
            return wb
    if _host_cast is not None and _needs_host_cast(m):
        if _fp8_stored_norm(m):
            kept = weights.kept_upcast(m, x)
            if kept is not None:
                return kept
        return _host_cast(m, x)
    return m.weight, m.bias


def bias_of(m, x):
    """`m`'s bias as `weights_of` reads it, without its weight where the layer's forward patch can give the bias
    alone (a layer whose weight is cast with its group's: engine/fp8/upcast.py)."""
    own = getattr(m.__dict__.get("forward"), "sdaccel_bias", None)
    if own is not None:
        b = own(x)
        if b is not None:
            return b[0]
    return weights_of(m, x)[1]


def _fp8_stored_norm(m):
    """A norm (not a Linear/Conv2d, whose copies the host plans where VRAM allows: engine/fp8/upcast.py) with
    fp8-stored weights: its fp16 copies are a few KB, and the host's cast of them costs every call a cast kernel
    and a sync with its offload stream."""
    w = getattr(m, "weight", None)
    return w is not None and w.dtype in weights.FP8_DTYPES and not isinstance(m, (nn.Linear, nn.Conv2d))


class FusedGroupNorm:
    """GroupNorm (+ the SiLU that followed it in its Sequential, when `sdaccel_act == "silu"`)."""
    sdaccel_kind = "group_norm"

    def forward(self, x):
        if stock_path.LOCAL.depth or stock_path.compiling() or host_replaced(self):
            out = stock_forward(self)(self, x)
            return F.silu(out) if self.sdaccel_act == "silu" else out
        w, b = weights_of(self, x)
        out = group_norm_silu(x, self.num_groups, w, b, self.eps, activation=self.sdaccel_act)
        kernel_report.record("group_norm_silu" if self.sdaccel_act else "group_norm", group_norm_silu.last_call)
        return out


class FusedLayerNorm:
    sdaccel_kind = "layer_norm"

    def forward(self, x):
        if stock_path.LOCAL.depth or stock_path.compiling() or host_replaced(self):
            return stock_forward(self)(self, x)
        w, b = weights_of(self, x) if self.weight is not None else (None, None)
        out = layer_norm(x, self.normalized_shape, w, b, self.eps)
        kernel_report.record("layer_norm", layer_norm.last_call)
        return out


class FusedGEGLU:
    """`a, gate = proj(x).chunk(2, -1); a * gelu(gate)` with the chunk, GELU and product fused.
    `proj` stays the host's own Linear module (it does its own casting and LoRA patching). Where `proj` computes in
    FP8 (precision fp8: engine/fp8/linear.py), the GEGLU runs in that GEMM's epilogue instead."""
    sdaccel_kind = "geglu"

    def forward(self, x):
        if stock_path.LOCAL.depth or stock_path.compiling() or host_replaced(self):
            return original_class(self).forward(self, x)
        in_epilogue = getattr(self.proj.__dict__.get("forward"), "sdaccel_geglu", None)
        out = in_epilogue(x) if in_epilogue is not None else None
        if out is not None:
            return out
        h = self.proj(x)
        out = geglu(h)
        kernel_report.record("geglu", geglu.last_call)
        return out


_HOST_METHODS = ("forward", "forward_comfy_cast_weights", "_forward")
_host_forwards = {}


def host_forwards(base):
    """(class dict, method name, function) of every forward the host class's MRO defines, as they were when SD
    Accel first planned a stand-in for (or around) one of its modules. The class dict is the live mappingproxy,
    read once: `cls.__dict__` makes a new one on every access."""
    if base not in _host_forwards:
        _host_forwards[base] = tuple((c.__dict__, name, c.__dict__[name]) for c in base.__mro__
                                     for name in _HOST_METHODS if name in c.__dict__)
    return _host_forwards[base]


def _replaced(impl):
    for d, name, fn in impl:
        if d.get(name) is not fn:
            return True
    return False


def host_replaced(m):
    """True when another pack has replaced a forward of `m`'s host class since SD Accel first stood in for one
    of its modules (AnimateDiff v1 swaps GroupNorm's forward for one that normalises across frames, for the
    UNet's call): the stand-in then runs the host's forward, whatever it is now, as stock would."""
    return _replaced(m.__dict__["_sdaccel_host_impl"])


def class_forward_replaced(cls):
    """`host_replaced` for a module a stand-in computes itself instead of calling (a ResBlock's out norm, a
    transformer block's norm2/norm3), by its class: call `host_forwards(cls)` when planning the stand-in, so
    the forwards compared against are the ones of that time."""
    return _replaced(host_forwards(cls))


def stock_forward(m):
    """The forward a norm stand-in runs where stock's computation is wanted: the host class's, whatever it is
    now (another pack's included), unless the planner named a plainer one (`sdaccel_stock_forward`: Forge's
    norms, whose replacements carry no `parameters_manual_cast`, name torch's own, which is what Forge's
    forward runs for a module it does not cast) and no pack has replaced the host's since."""
    own = m.__dict__.get("sdaccel_stock_forward")
    return own if own is not None and not host_replaced(m) else original_class(m).forward


def kind_of(m):
    """What SD Accel put there ("group_norm", "resblock", "layout", ...), or None for a module of the host or any
    other value a host's object patch holds (ModelComputeDtype's is a torch.dtype, which has no __dict__)."""
    return getattr(m, "__dict__", {}).get("sdaccel_kind") or getattr(type(m), "sdaccel_kind", None)


def is_fused(m):
    return kind_of(m) is not None


def original_class(m):
    """The host class a stand-in stands in for: its own class (stand-ins are instances of it)."""
    return type(m)


@functools.lru_cache(maxsize=None)
def mixin_members(mixin):
    """{name: value} a mixin class defines (its bases' first), without Python's own attributes. Read once per
    mixin (the host's stock path compares stand-ins against it every sampling run); not to be modified."""
    out = {}
    for c in reversed(mixin.__mro__[:-1]):
        out.update((k, v) for k, v in c.__dict__.items() if not (k.startswith("__") and k.endswith("__")))
    return out


def own_method_residue(m, name):
    """True when `m.__dict__[name]` is `m`'s own class method bound to `m`: what a pack's unhook leaves behind
    (BrushNet's `layer.forward = layer.original_forward`). It computes as no instance attribute would, but copied
    into a stand-in or a copy it would call `m` instead of the copy: such an attribute is not copied."""
    v = m.__dict__.get(name)
    return v is not None and is_own_method(v, m, name)


def is_own_method(value, m, name):
    """True when `value` is `m`'s class method `name` bound to `m` itself."""
    return getattr(value, "__self__", None) is m and getattr(value, "__func__", None) is getattr(type(m), name, None)


def instance_state(m):
    """`m.__dict__`'s items without own-method residues of the host's forwards (`own_method_residue`)."""
    return [(k, v) for k, v in m.__dict__.items() if k not in _HOST_METHODS or not own_method_residue(m, k)]


def _clone_into(cls, orig):
    new = cls.__new__(cls)
    theirs = mixin_members(orig.__dict__["sdaccel_mixin"]) if "sdaccel_mixin" in orig.__dict__ else {}
    new.__dict__.update((k, v) for k, v in instance_state(orig) if k not in theirs)
    # nn.Module keeps params/buffers/children/hooks in dicts. The hooks' and other dicts are copied, so the stand-in
    # can be given its own without touching the original module. Shared:
    # - parameters and buffers: a weight patch (ComfyUI's set_attr_param replaces the Parameter object) reaches
    #   both, as it reaches stock's module. With copies, a stand-in planned while another clone's patches were
    #   applied kept those patched tensors (and one kept across prompts missed every later patch made while the
    #   original was in place): the host's next patch then started from them, and its unpatch put them back, so
    #   stock's next image came out wrong too.
    # - children (`_modules`): a stand-in with children (ResBlock, SpatialTransformer, transformer block) has the
    #   original's children, and the host patches a child through the stand-in's path. With a copy, a stand-in
    #   planned while an earlier one was applied would start from the earlier patched children, and the host,
    #   restoring in its order, would leave a fused child on the original.
    for k, v in orig.__dict__.items():
        if isinstance(v, (dict, set)) and k not in _SHARED_DICTS and k not in theirs:
            new.__dict__[k] = v.copy()
    shared_state.link(orig, new)   # the host's marks on the weights' state (engine/patches/shared_state.py)
    return new


_SHARED_DICTS = ("_modules", "_parameters", "_buffers")


def host_source(cls, method, params):
    """The source of `cls.<method>` when `cls` itself defines it with exactly these parameter names and no forward
    of `cls` is another pack's (`foreign_forwards`), else None. Stand-ins that re-implement a host method (a
    SpatialTransformer's forward, a ResBlock's _forward) check it for the steps they reproduce."""
    if foreign_forwards(cls):
        return None
    return _own_source(cls, method, params)


def foreign_forwards(cls):
    """The forwards `cls` defines that another pack set on the class: a function defined in another module, or a
    wrapper of the host's (LayerDiffuse wraps BasicTransformerBlock.forward when it is imported, to record each
    call's transformer_options). A stand-in in place of such a module would skip that pack's code: a wrong image.
    `inspect.getsource` follows a wrapper to the source it wraps, so the function object itself is checked."""
    return [name for name in _HOST_METHODS if name in cls.__dict__ and not _defined_with(cls, cls.__dict__[name])]


def _defined_with(cls, fn):
    return getattr(fn, "__module__", None) == cls.__module__ and getattr(fn, "__wrapped__", None) is None


def foreign_forwards_reason(root, names):
    """One line naming the classes (of `names`, under `root`) whose forwards another pack replaced, or None."""
    found = {}
    for m in root.modules():
        cls = original_class(m)
        if cls.__name__ in names and cls not in found:
            found[cls] = foreign_forwards(cls)
    found = ["%s.%s" % (cls.__name__, "/".join(methods)) for cls, methods in found.items() if methods]
    if not found:
        return None
    return ("another pack replaced %s on the class: those modules keep its forward, unfused" % ", ".join(found))


@functools.lru_cache(maxsize=None)
def _own_source(cls, method, params):
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
    """A stand-in for `orig`: an instance of orig's own class sharing its tensors and children, with the
    mixin's methods and attributes set on the instance. Its own class, not a subclass: packs place their
    modules by exact class (AnimateDiff: `type(c) == SpatialTransformer`, `type(c).__name__ == "ResBlock"`)
    and must find ours as they find the host's. A mixin calls the host's method as
    `original_class(self).forward(self, ...)` (no `super()`: the mixin is not in the instance's class)."""
    base = original_class(orig)
    new = _clone_into(base, orig)
    theirs = set() if "sdaccel_mixin" in orig.__dict__ else {k for k, _ in instance_state(orig)}
    for name, value in mixin_members(mixin).items():
        if isinstance(value, (property, classmethod, staticmethod)):
            raise TypeError("%s.%s: a stand-in's members are set on the instance, where only plain methods "
                            "and values work" % (mixin.__name__, name))
        if name in theirs and name in _HOST_METHODS:
            continue    # another pack set its own forward on this module: it keeps running, as on stock
        new.__dict__[name] = value
    new.__dict__["sdaccel_mixin"] = mixin
    new.__dict__["_sdaccel_host_impl"] = host_forwards(base)
    return bind_methods(new)


def bind_methods(m):
    """`m` with its stand-in methods bound to `m` itself: call it on a shallow copy of a stand-in, whose
    dict still holds the methods bound to the module it was copied from."""
    mixin = m.__dict__.get("sdaccel_mixin")
    if mixin is not None:
        for name, value in mixin_members(mixin).items():
            here = m.__dict__.get(name)
            if isinstance(value, types.FunctionType) and (here is value or getattr(here, "__func__", None) is value):
                m.__dict__[name] = types.MethodType(value, m)
    return m


def make_fused_group_norm(orig, act):
    new = clone_as(FusedGroupNorm, orig)
    new.sdaccel_act = act
    return new


def make_fused_layer_norm(orig):
    return clone_as(FusedLayerNorm, orig)


def make_fused_geglu(orig):
    return clone_as(FusedGEGLU, orig)


class SiLUFolded(nn.Identity):
    """Stands where an nn.SiLU was, once the SiLU is fused into the GroupNorm before it."""
    sdaccel_kind = "silu_folded"


def is_group_norm(m):
    """A GroupNorm the fused kernel computes as the host does (`computes_plainly`)."""
    return isinstance(m, nn.GroupNorm) and computes_plainly(m)


def is_layer_norm(m):
    """A LayerNorm over the last dim the fused kernel computes as the host does (`computes_plainly`)."""
    return isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1 and computes_plainly(m)


def is_geglu(m):
    # ComfyUI's and ldm's GEGLU: a `proj` Linear to 2*dim, then chunk/gelu/mul in forward
    return original_class(m).__name__ == "GEGLU" and isinstance(getattr(m, "proj", None), nn.Linear)


def is_silu(m):
    return isinstance(m, (nn.SiLU, SiLUFolded))


