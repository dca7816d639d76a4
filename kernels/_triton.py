"""The guarded Triton import, and the checks of whether a Triton kernel can take a tensor.

Triton is optional: nothing here raises at import time. Op files call `get_triton()` once at their own
import and define their @triton.jit kernels only when it returns a module pair, so importing an op on a
machine without Triton still works and every call falls back to the op's plain-torch reference.

`TRITON_INTERPRET=1` (Triton's CPU interpreter, read by Triton when it is first imported) is how CI
checks kernels without a GPU; only then are CPU tensors accepted.

Every `*_ineligible` helper returns why the kernels cannot take its arguments, or None when they can;
each op's `eligible` strings them together in its own order.
"""
import os

import torch

from . import _device

MIN_CAPABILITY = (7, 0)  # Triton's oldest supported NVIDIA target (Volta)
FORWARD_ONLY = "autograd needed (kernel is forward only)"

_triton_pair = None  # (triton, triton.language) once imported, False when the import failed


def get_triton():
    """(triton, triton.language), or None when Triton is missing or broken. Never raises."""
    global _triton_pair
    if _triton_pair is None:
        try:
            import triton
            import triton.language as tl
            _triton_pair = (triton, tl)
        except Exception:  # ImportError, or a broken install raising anything at import
            _triton_pair = False
    return _triton_pair or None


def interpret_mode():
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def triton_runnable(t):
    """(True, "") when a Triton kernel can run on tensor `t`'s device, else (False, short reason)."""
    if get_triton() is None:
        return False, "no Triton"
    if t.device.type == "cuda":
        major, minor = _device.capability(t.device)
        if (major, minor) < MIN_CAPABILITY:
            return False, f"GPU sm_{major}{minor} < sm_{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]}"
        # (a capture under cudaMallocAsync is handled by _launch.launch: see there)
        return True, ""
    if t.device.type == "cpu":
        if interpret_mode():
            return True, ""
        return False, "CPU tensor"
    return False, f"{t.device.type} tensor"


def is_channels_last(t):
    """4-D and stored channels_last but not also NCHW-contiguous (a tensor can be both when C == 1 or
    H * W == 1; NCHW addressing is then right for it too)."""
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def device_dtype_ineligible(x, dtypes):
    """Why no kernel runs on `x`'s device or takes its dtype."""
    ok, why = triton_runnable(x)
    if not ok:
        return why
    if x.dtype not in dtypes:
        return f"dtype {x.dtype}"
    return None


def dense_ineligible(x):
    """Why the row kernels (layer_norm, add_layer_norm, geglu) cannot address `x` as one flat block."""
    if x.numel() == 0:
        return "empty input"
    if not x.is_contiguous():
        return "non-contiguous input"
    if x.numel() >= 2**31:
        return "too large for int32 offsets"
    return None


def activation_ineligible(x, dtypes):
    """Why the per-channel kernels (group_norm_silu, bias_residual_add) cannot take activation `x` of shape
    [N, C, ...] (3-D or 4-D, NCHW-contiguous or channels_last)."""
    why = device_dtype_ineligible(x, dtypes)
    if why:
        return why
    if x.dim() not in (3, 4):
        return f"{x.dim()}-D input"
    if not (x.is_contiguous() or is_channels_last(x)):
        return "layout neither contiguous nor channels_last"
    if x.numel() == 0:
        return "empty input"
    if x.numel() >= 2**31:
        return "too large for int32 offsets"
    if x.shape[0] > 65535:
        return "batch > 65535 (grid limit)"
    return None


def vectors_ineligible(x, size, size_name, **params):
    """Why a parameter vector (weight, bias: None or a contiguous float [size] tensor on x's device) does
    not fit `x`; `size_name` names the axis it runs along in the reason ("C", "D")."""
    for name, p in params.items():
        if p is None:
            continue
        if p.device != x.device or not p.is_floating_point() or p.shape != (size,) or p.stride() != (1,):
            return f"{name} not a contiguous float [{size_name}] tensor on x's device"
    return None


def forward_only_ineligible(*tensors):
    """FORWARD_ONLY when autograd would need a gradient through one of `tensors` (None entries skipped)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return FORWARD_ONLY
    return None


def __getattr__(name):
    # the engine's eager step (engine/graphs/eager.py) reaches compile-ahead through this module; it lives in
    # _compile_ahead, imported here on first use because _compile_ahead itself imports this module
    if name in ("compile_ahead_available", "run_compiling_ahead"):
        from . import _compile_ahead
        return getattr(_compile_ahead, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
