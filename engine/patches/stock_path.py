"""A switch that makes SD Accel's stand-in modules compute exactly what the modules they replace compute.

Fused kernels pay inside CUDA graphs, where a step costs only its GPU time. Eagerly, each launch also costs
host time, and where the host is the bound (SD1.5 at batch 1) the stock modules are the faster path. A step
that runs eagerly (graphs refused for it, or off) can run inside `stock_modules()`: every stand-in then
calls its host class's own forward (a fused GroupNorm+SiLU runs the GroupNorm and the SiLU the host would have
run), so the result is stock's, bit for bit, at stock's speed. Per thread: a scope on one thread never changes
what another computes.
"""
import contextlib

import torch

from ..thread_scope import ThreadScope

_SCOPE = ThreadScope()
LOCAL = _SCOPE.local    # `LOCAL.depth` (> 0: active): the stand-ins' per-call test, read without a call

# True while torch.compile traces (a TorchCompileModel placed after Apply SD Accel compiles a UNet holding the
# stand-ins): they then trace as the host's own modules. The scope alone did not reach them there: dynamo on
# the GPU machine's torch traced a fused kernel's launch inside one and failed the prompt. ~70 ns a call.
compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)


def active():
    """True inside a `stock_modules()` scope on this thread."""
    return LOCAL.depth > 0


def stock_modules():
    return _SCOPE.entered()


@contextlib.contextmanager
def fused_modules():
    """Leaves any `stock_modules()` scope of this thread for the calls inside: the stand-ins compute their own way
    again (a call that reaches SD Accel's step from inside a scope a host entered around another pack's code)."""
    depth, LOCAL.depth = LOCAL.depth, 0
    try:
        yield
    finally:
        LOCAL.depth = depth
