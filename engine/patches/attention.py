"""Attention backends, chosen per call.

`attention_fn(backend)` returns `fn(q, k, v, heads) -> out` over ldm's layout (q, k, v: batch x tokens x
heads*dim_head; out the same), the shape of ldm's attention calls. Per call it uses the
requested backend where it can run and PyTorch's SDPA otherwise, recording why:
  * "sdpa": torch.nn.functional.scaled_dot_product_attention (PyTorch picks flash/cuDNN/efficient);
  * "xformers": xformers.ops.memory_efficient_attention, when xformers imports and the tensors are on
    a CUDA device;
  * "sage": sageattention.sageattn, when installed, on CUDA, fp16/bf16, and a head dim its INT8 kernels
    support (64/96/128: SD1.5's 40/80/160 are not, so SD1.5 falls back; SDXL's 64 runs).
"""
import importlib

import torch
import torch.nn.functional as F

from ...kernels._dispatch import REFERENCE, Outcome
from ..reports import kernel_report

BACKENDS = ("auto", "sdpa", "xformers", "sage")
# The transformer option under which a host hands `attention_fn(backend)` to the fused transformer blocks.
# An option, never an attention replace patch: packs that patch attention (IPAdapter) set and extend replace
# patches per block, and one of ours there would take their place or break their own additions.
TRANSFORMER_OPTION = "sd_accel_attention"
# Current ComfyUI's per-call attention function (`optimized_attention_override`, a transformer option): where another
# pack set one (KJNodes' Sage and Flash attention patches), it decides every block's attention, SD Accel's fused
# blocks included; SD Accel's own override there carries OURS.
HOST_OVERRIDE = "optimized_attention_override"
OURS = "sd_accel_backend"
SAGE_HEAD_DIMS = (64, 96, 128)
_modules = {}


def _optional(name):
    if name not in _modules:
        try:
            _modules[name] = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - any failure to import means "not available"
            _modules[name] = None
    return _modules[name]


def _split(t, heads):
    b, n, _ = t.shape
    return t.view(b, n, heads, -1)


def sdpa(q, k, v, heads):
    b, n, inner = q.shape
    q, k, v = (_split(t, heads).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).reshape(b, n, inner)


def _xformers(q, k, v, heads):
    xops = _optional("xformers.ops")
    b, n, inner = q.shape
    out = xops.memory_efficient_attention(*(_split(t, heads).contiguous() for t in (q, k, v)))
    return out.reshape(b, n, inner)


def _sage(q, k, v, heads):
    sage = _optional("sageattention")
    b, n, inner = q.shape
    out = sage.sageattn(*(_split(t, heads) for t in (q, k, v)), tensor_layout="NHD", is_causal=False)
    return out.reshape(b, n, inner)


def eligible(backend, q, heads):
    """(True, "") when `backend` can run this call, else (False, why)."""
    if backend == "sdpa":
        return True, ""
    if not q.is_cuda:
        return False, "%s needs a CUDA tensor" % backend
    if backend == "xformers":
        return (_optional("xformers.ops") is not None, "xformers not installed")
    if backend == "sage":
        if _optional("sageattention") is None:
            return False, "sageattention not installed"
        d = q.shape[-1] // heads
        if d not in SAGE_HEAD_DIMS:
            return False, "head dim %d not supported by SageAttention" % d
        if q.dtype not in (torch.float16, torch.bfloat16):
            return False, "SageAttention needs fp16/bf16"
        return True, ""
    return False, "unknown backend %r" % backend


_IMPL = {"sdpa": sdpa, "xformers": _xformers, "sage": _sage}


def attention_fn(backend):
    if backend not in _IMPL:
        raise ValueError("attention backend must be one of %s" % (BACKENDS[1:],))
    ran = Outcome(backend)   # what kernel_report files: the backend's name, or "reference" (SDPA) and why

    def attend(q, k, v, heads):
        ok, why = eligible(backend, q, heads)
        out = _IMPL[backend if ok else "sdpa"](q, k, v, heads)
        kernel_report.record("attention_" + backend, ran if ok else Outcome(REFERENCE, why))
        return out
    attend.sd_accel_backend = backend
    return attend


def another_packs_override(transformer_options):
    """Whether another pack's function is at the host's attention override."""
    fn = transformer_options.get(HOST_OVERRIDE)
    return fn is not None and not getattr(fn, OURS, False)
