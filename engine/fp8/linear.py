"""The FP8 Linear forward (precision "fp8", LOSSY): set as the host Linear's own forward (a forward patch:
engine/patches/forward_patches.py), it quantizes the activations per token on the GPU, multiplies
with the weight's FP8 copy (per output channel scales, made once per weight: engine/fp8/weights.py) in
`torch._scaled_mm` with fp32 accumulation, and adds the bias in the GEMM's epilogue.

It reads `self.weight` itself, so a LoRA or weight patch applied to the Parameter (ComfyUI's normal mode) is
what gets quantized. Where the host computes the weight per call (current ComfyUI's `weight_function` /
`bias_function`: LoRA on an offloaded or low-VRAM model; or weights cast from another device), the patched
weight exists only inside the host's forward, so the host's forward runs, fp16, and the report says why.
A weight already stored as float8_e4m3fn (an fp8 checkpoint) is used as stored, scale 1.
"""
import torch

from ...kernels._dispatch import REFERENCE, Outcome
from ..patches import fused_modules as fm
from ..patches import stock_path
from ..patches.forward_patches import ForwardPatch
from ..reports import kernel_report
from . import gemm, weights

OP = "fp8_linear"


class Fp8Forward(ForwardPatch):
    sdaccel_kind = "fp8_linear"

    def compute(self, x):
        return self._fp8(x, geglu=False)

    def sdaccel_geglu(self, x):
        """GEGLU of this projection's output (`a * gelu(gate)` of its two halves) from one FP8 GEMM with the GEGLU
        in its epilogue, for the fused GEGLU module that owns this Linear (engine/patches/fused_modules.py); None
        where this forward would not compute in FP8 itself, or the recipe has no GEGLU epilogue."""
        if stock_path.LOCAL.depth or stock_path.compiling() or fm.class_forward_replaced(type(self.module)):
            return None
        return self._fp8(x, geglu=True)

    def _fp8(self, x, geglu):
        m = self.module
        why, recipe = fp8_refusal(m, x)
        if why:
            kernel_report.record(OP, Outcome(REFERENCE, why))
            return None
        if geglu and recipe not in gemm.GEGLU_RECIPES:
            return None
        wq, ws = fp8_weights(m)
        bias = m.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        x2 = x.reshape(-1, x.shape[-1])
        out = gemm.fp8_geglu(x2, wq, ws, bias) if geglu else gemm.fp8_linear(x2, wq, ws, bias, recipe)
        kernel_report.record(OP, Outcome("fp8", "", recipe + (" + geglu" if geglu else "")))
        return out.reshape(x.shape[:-1] + (out.shape[-1],))


def fp8_weights(m):
    """(q, scale) of `m.weight`: as stored where it is float8_e4m3fn without a checkpoint scale, else its
    per-channel FP8 copy."""
    w = m.weight
    if w.dtype == torch.float8_e4m3fn and getattr(m, "scale_weight", None) is None:
        return w, torch.ones((1, w.shape[0]), device=w.device, dtype=torch.float32)
    return weights.fp8_of(w)


def fp8_refusal(m, x):
    """(why the host's forward runs instead, or None; the `_scaled_mm` recipe)."""
    w = m.weight
    if x.dtype != torch.float16:
        return "activations in %s (FP8 compute runs fp16 models)" % x.dtype, None
    if getattr(m, "weight_function", None) or getattr(m, "bias_function", None):
        return "weights patched per call by the host (LoRA on an offloaded model): fp16", None
    if w is None or w.device != x.device or (m.bias is not None and m.bias.device != x.device):
        return "weights not on the input's device (offloaded): fp16", None
    if w.dtype == torch.float8_e4m3fn and getattr(m, "scale_weight", None) is not None:
        return "scaled fp8 checkpoint weights: fp16 (the host's own cast)", None
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return "autograd needed", None
    if x.is_cuda and not gemm.probed(x.device) and torch.cuda.is_current_stream_capturing():
        # the probe reads its result on the host, which a capture cannot: the graph keeps fp16 for this layer
        return "FP8 recipe not chosen before this graph capture: fp16", None
    recipe = gemm.probe(x.device)
    if recipe is None:
        return gemm.NO_RECIPE, None
    return None, recipe


def make_fp8_linear(orig):
    """The FP8 forward patch for Linear `orig` (set as `orig.forward`: engine/patches/forward_patches.py)."""
    return Fp8Forward(orig)
