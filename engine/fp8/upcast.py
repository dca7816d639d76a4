"""fp8-stored checkpoints at precision fp16 (lossless): ComfyUI computes with manual cast, upcasting every fp8
weight to fp16 at every call, which costs each step a read of the fp8 weights and a write and read of fp16 ones.
The forward patch here (set as the layer's own forward: engine/patches/forward_patches.py) keeps the upcast fp16
copy (engine/fp8/weights.py: keyed on the weight tensor, so a LoRA or weight patch makes a new one) and computes
with it: the same values ComfyUI's cast gives, without the per-step cast. Planned only where the copies fit in free
VRAM (the host decides); the copies are counted in the report.
Where the host computes the weight per call (`weight_function`, `bias_function`: LoRA on a low-VRAM model) or
the weight is elsewhere than the input, the host's own forward runs.
"""
import torch
import torch.nn.functional as F
from torch import nn

from ..patches.forward_patches import ForwardPatch, path_of
from . import weights



class UpcastForward(ForwardPatch):
    sdaccel_kind = "fp8_upcast"
    # where graphs do not run and the eager step takes the stock modules (engine/graphs/eager.py), the layer still
    # reads its kept copy: the host's values, without the host's per-call cast, which made that step slower
    # than stock's own
    on_stock_path = True

    def compute(self, x):
        wb = self.sdaccel_weights(x)
        if wb is None:
            return None
        if isinstance(self.module, nn.Conv2d):
            return self.module._conv_forward(x, *wb)
        return F.linear(x, *wb)

    def sdaccel_weights(self, x):
        """(fp16 weight, bias) in x's dtype from the kept copy, or None where the host's cast must run."""
        return weights.kept_upcast(self.module, x)


# what an fp8-stored checkpoint's weights become (the nodes' `fp8_weights`): one fp16 copy each where the GPU has
# room (fastest), or kept as stored, cast per call as the host does (the UNet's weights in half an fp16 model's VRAM)
MODES = ("fp16 copies", "as stored")


def is_fp8_stored(m):
    """A host Linear/Conv2d whose weight is stored in fp8 and cast per call by the host (manual cast)."""
    w = getattr(m, "weight", None)
    return isinstance(m, (nn.Linear, nn.Conv2d)) and w is not None and w.dtype in weights.FP8_DTYPES and \
        bool(getattr(m, "comfy_cast_weights", False))


def plan_upcast(root, prefix=""):
    """({prefix + path + ".forward": forward patch} for every fp8-stored Linear/Conv2d under `root`, bytes their
    fp16 copies take)."""
    out, nbytes = {}, 0
    for name, mod in root.named_modules():
        if name and is_fp8_stored(mod):
            out[path_of(prefix + name)] = UpcastForward(mod)
            nbytes += mod.weight.numel() * 2
    return out, nbytes
