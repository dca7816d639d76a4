"""Lazy, guarded Triton import and the "can a Triton kernel run on this tensor?" check.

Triton is optional: nothing here raises at import time. Op files call `get_triton()` once at their own
import and define their @triton.jit kernels only when it returns a module pair, so importing an op on a
machine without Triton still works and every call falls back to the op's plain-torch reference.

`TRITON_INTERPRET=1` (Triton's CPU interpreter, read by Triton when it is first imported) is how CI
checks kernels without a GPU; only then are CPU tensors accepted.
"""
import os

import torch

MIN_CAPABILITY = (7, 0)  # Triton's oldest supported NVIDIA target (Volta)

_triton_pair = None  # (triton, triton.language) once imported, False when the import failed
_capability = {}     # device index -> (major, minor); cached so eligibility checks cost no driver calls


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


def _device_capability(device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capability:
        _capability[index] = torch.cuda.get_device_capability(index)
    return _capability[index]


_async_alloc = None


def async_allocator():
    """True when PyTorch's CUDA allocator is cudaMallocAsync (ComfyUI's default on NVIDIA)."""
    global _async_alloc
    if _async_alloc is None:
        try:
            _async_alloc = torch.cuda.get_allocator_backend() == "cudaMallocAsync"
        except Exception:  # noqa: BLE001 - old torch or no CUDA: the native allocator
            _async_alloc = False
    return _async_alloc


def triton_runnable(t):
    """(True, "") when a Triton kernel can run on tensor `t`'s device, else (False, short reason)."""
    if get_triton() is None:
        return False, "no Triton"
    if t.device.type == "cuda":
        major, minor = _device_capability(t.device)
        if (major, minor) < MIN_CAPABILITY:
            return False, f"GPU sm_{major}{minor} < sm_{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]}"
        if torch.cuda.is_current_stream_capturing() and async_allocator():
            # Under cudaMallocAsync, memory allocated during a capture has no address the driver
            # will confirm until the graph is instantiated, and Triton's launcher checks every
            # pointer (cuPointerGetAttribute): the launch would fail. Seen on an H200, triton 3.6.
            return False, "CUDA-graph capture under cudaMallocAsync (use --disable-cuda-malloc to fuse in graphs)"
        return True, ""
    if t.device.type == "cpu":
        if interpret_mode():
            return True, ""
        return False, "CPU tensor"
    return False, f"{t.device.type} tensor"


def num_warps_for(tile_elems):
    """Warps for a memory-bound tile: about 16-32 elements per thread keeps enough loads in flight."""
    if tile_elems <= 2048:
        return 4
    if tile_elems <= 8192:
        return 8
    return 16


def cdiv(a, b):
    return -(-a // b)


def next_pow2(n):
    return 1 << max(0, int(n) - 1).bit_length()


def record(fn, path, reason=""):
    """Note on the public op `fn` which path ran, so tests can tell the kernel from the fallback."""
    fn.last_path = path
    fn.last_reason = reason
    fn.calls[path] = fn.calls.get(path, 0) + 1


def init_record(fn):
    """Give a public op its `last_path` / `last_reason` / `calls` attributes before its first call."""
    fn.last_path = None
    fn.last_reason = ""
    fn.calls = {"triton": 0, "reference": 0}
    return fn
