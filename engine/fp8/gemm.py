"""One FP8 Linear: `x @ w.T + bias` with x quantized per token (kernels/quantize_rows.py), w quantized per output
channel once per load, a GEMM accumulating in fp32, the bias added in its epilogue.

The first call on a device tries the recipes on a tiny problem, fastest first, and keeps the first that runs (on
its fast path) and agrees with an fp32 reference. A try where the "triton" recipe's kernels were not compiled yet
(a pass compiling kernels ahead, where each op runs its plain-torch reference meanwhile) says nothing of those
kernels: its choice serves that call only, and the next call tries again:
  * "triton": kernels/fp8_gemm.py, scales, bias (and GEGLU where asked) in the GEMM's epilogue, fp16 out: one pass
    over the output. `torch._scaled_mm` takes rowwise scales only with a bfloat16 output on sm_89/sm_90, so the
    recipes below pay a cast and a bias add afterwards, which cost about what FP8 saves;
  * "rowwise_fp16": per-token activation scales and per-channel weight scales in `_scaled_mm`, fp16 out, bias
    fused;
  * "rowwise_bf16": the same with a bfloat16 output, cast to fp16, bias added after (in fp16);
  * "tensorwise": one activation scale per call, fp32 out, the per-channel weight scale and the bias applied
    after (one fused multiply-add).
"""
import torch

from ...kernels._compile_ahead import CompilingAhead
from ...kernels._dispatch import TRITON
from ...kernels._launch import NotWarmedUp
from ...kernels.fp8_gemm import fp8_gemm
from ...kernels.quantize_rows import quantize_rows, quantize_tensor_reference, quantize_weight_per_channel

RECIPES = ("triton", "rowwise_fp16", "rowwise_bf16", "tensorwise")
GEGLU_RECIPES = ("triton",)     # the recipes with GEGLU in their epilogue (fp8_geglu)
_PROBE_TOL = 6e-2
NO_RECIPE = "no torch._scaled_mm recipe runs on this device: fp16"   # the reason where the probe finds none
_chosen = {}      # (device type, index) -> recipe name, or None when none runs


def _triton(x, wq, ws, bias, geglu=False):
    xq, xs = quantize_rows(x)
    return fp8_gemm(xq, xs, wq, ws, bias, geglu=geglu)


_NOT_COMPILED_YET = (CompilingAhead.reason, NotWarmedUp.reason)


def _triton_ran():
    """Both of the "triton" recipe's kernels ran on the latest call (not their plain-torch references)."""
    return quantize_rows.last_call.path == TRITON and fp8_gemm.last_call.path == TRITON


def _triton_not_compiled_yet():
    """The latest call of the "triton" recipe ran a reference only because a kernel had no binary yet."""
    return any(op.last_call.reason in _NOT_COMPILED_YET for op in (quantize_rows, fp8_gemm))


def _rowwise_fp16(x, wq, ws, bias):
    xq, xs = quantize_rows(x)
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, bias=bias, out_dtype=torch.float16)


def _rowwise_bf16(x, wq, ws, bias):
    xq, xs = quantize_rows(x)
    out = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16).to(torch.float16)
    return out if bias is None else out.add_(bias)


def _tensorwise(x, wq, ws, bias):
    xq, xs = quantize_tensor_reference(x)
    one = torch.ones((), device=x.device, dtype=torch.float32)
    out = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=one, out_dtype=torch.float32)
    out = out.mul_(ws) if bias is None else torch.addcmul(bias.float(), out, ws)
    return out.to(torch.float16)


_RECIPE_FNS = {"triton": _triton, "rowwise_fp16": _rowwise_fp16, "rowwise_bf16": _rowwise_bf16,
               "tensorwise": _tensorwise}


def _key(device):
    index = device.index
    if device.type == "cuda" and index is None:   # a host's "cuda" and a tensor's "cuda:0" are one device
        index = torch.cuda.current_device()
    return device.type, index


def probe(device):
    """The recipe `device` runs (see the module doc), tried until a try settles it; None when none runs."""
    key = _key(device)
    if key not in _chosen:
        name, settled = _first_working(device)
        if not settled:
            return name
        _chosen[key] = name
    return _chosen[key]


def probed(device):
    """Whether `device`'s recipe is settled (a probe there would not run the tiny problem again)."""
    return _key(device) in _chosen


def _first_working(device):
    """(the first recipe that runs and agrees, or None; whether that is settled for the device)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g).to(device, torch.float16)
    w = torch.randn(48, 64, generator=g).to(device, torch.float16)
    bias = torch.randn(48, generator=g).to(device, torch.float16)
    ref = torch.addmm(bias.float(), x.float(), w.float().t())
    wq, ws = quantize_weight_per_channel(w)
    settled = True
    for name in RECIPES:
        try:
            out = _RECIPE_FNS[name](x, wq, ws, bias)
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            continue
        if name == "triton" and not _triton_ran():
            settled = settled and not _triton_not_compiled_yet()
            continue
        if out.dtype == torch.float16 and out.shape == ref.shape and \
                float((out.float() - ref).norm() / ref.norm()) < _PROBE_TOL:
            return name, settled
    return None, settled


def fp8_linear(x, wq, ws, bias, recipe):
    """fp16 [M, N] = x [M, K] fp16 @ dequant(wq [N, K] fp8, ws [1, N] fp32).T + bias [N] fp16 (or None)."""
    return _RECIPE_FNS[recipe](x, wq, ws, bias)


def fp8_geglu(x, wq, ws, bias):
    """GEGLU of the FP8 projection, `a * gelu(gate)` for `a, gate = fp8_linear(...).chunk(2, -1)`, with the
    chunk, GELU and product in the GEMM's epilogue (recipe "triton" only)."""
    return _triton(x, wq, ws, bias, geglu=True)


def shapes_refusal(in_features, out_features):
    """None when `_scaled_mm` takes a Linear of these sizes (both multiples of 16), else why not."""
    if in_features % 16 or out_features % 16:
        return "features %dx%d not multiples of 16" % (in_features, out_features)
    return None
