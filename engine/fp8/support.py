"""Where FP8 compute may run: GPUs with e4m3 tensor cores (Ada sm_89, Hopper sm_90) and a torch with
`torch._scaled_mm`, where one of the GEMM recipes runs (engine/fp8/gemm.probe). Anything else gets one line saying
why, and the model runs in fp16.

The recipe is chosen here, when a host plans FP8 for a model, never first inside a step: the probe reads its
result on the host, which inside a step's warm-up reads as a step that waits for the GPU (no graphs for it), and
inside a pass compiling kernels ahead the Triton recipe's kernels have not run yet."""
import torch

from ...kernels import _device
from . import gemm

FP8_CAPABILITIES = ((8, 9), (9, 0))
LOSSY_NOTE = ("precision fp8: LOSSY (the feed-forward's GEGLU projections in FP8 e4m3, per-channel weight and "
              "per-token activation scales; the image changes slightly)")


def refusal(device):
    """None when FP8 compute can run on `device` (a torch.device or its string), else why not."""
    device = torch.device(device) if device is not None else None
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return "this torch has no torch._scaled_mm / float8_e4m3fn: fp16"
    if device is None or device.type != "cuda":
        return "FP8 compute needs an Ada or Hopper GPU (sm_89/sm_90); this model runs on %s: fp16" % (
            device.type if device is not None else "no device")
    major, minor = _device.capability(device)
    if (major, minor) not in FP8_CAPABILITIES:
        return "FP8 compute needs an Ada or Hopper GPU (sm_89/sm_90); this GPU is sm_%d%d: fp16" % (major, minor)
    if gemm.probe(device) is None:
        return gemm.NO_RECIPE
    return None
