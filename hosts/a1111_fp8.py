"""precision "fp8" (LOSSY, opt-in) on AUTOMATIC1111's UNet: the FP8 Linear forward (engine/fp8/linear.py) set as the
own `forward` of each transformer block's feed-forward GEGLU projection (an instance attribute: the Linear, its
Parameters and A1111's bookkeeping on it stay in place), taken off by deleting that attribute.

What A1111's own Linear forward does first has to happen here too:
* its Lora extension writes the wanted networks' weights into the Linear's Parameter before computing
  (hosts/a1111_lora.py): done first, so the FP8 copy is made from the patched weight. The copy is keyed on the
  Parameter's version counter (the write is in place) and on the wanted networks (the graphs' host state holds
  them too), so a LoRA change never leaves stale FP8 weights. With `lora_functional` on and a network loaded,
  A1111 adds the networks' outputs per call: the host's forward runs (fp16), and the kernel report says why.
* under autocast (A1111 runs fp16 UNets under it) `F.linear` casts fp32 activations to fp16: so does this.
With --medvram / --lowvram A1111 moves the UNet's weights to the GPU per call, so their FP8 copies would be made
again at every step: FP8 is refused there, with the reason.
"""
import torch

from ..engine.fp8 import support, weights
from ..engine.fp8.linear import OP, Fp8Forward
from ..engine.fp8.plan import plan_fp8
from ..engine.patches import patching
from ..engine.patches.forward_patches import ATTR
from ..engine.reports import kernel_report
from ..kernels._dispatch import REFERENCE, Outcome
from . import a1111_lora

FUNCTIONAL_LORA = "A1111 adds LoRA outputs per call (lora_functional on): fp16"
LOWVRAM = ("A1111's --medvram/--lowvram moves the UNet's weights to the GPU per call (their FP8 copies would be "
           "made again at every step): fp16")


class A1111Fp8Forward(Fp8Forward):
    def _fp8(self, x, geglu):
        networks = a1111_lora.wanted_names()
        if networks and a1111_lora.functional():
            kernel_report.record(OP, Outcome(REFERENCE, FUNCTIONAL_LORA))
            return None
        a1111_lora.apply_weights(self.module)
        device = x.device.type
        if x.dtype == torch.float32 and torch.is_autocast_enabled(device) \
                and torch.get_autocast_dtype(device) == torch.float16:
            x = x.half()
        with weights.host_state(("a1111 networks", networks)):
            return super()._fp8(x, geglu)


def refusal(unet, lowvram):
    """None where FP8 compute can run on `unet`, else the one-line reason (the UNet then runs fp16)."""
    p = next(unet.parameters(), None)
    why = support.refusal(p.device if p is not None else None)
    if why is None and lowvram:
        why = LOWVRAM
    return why


def set_forwards(unet):
    """Sets the FP8 forwards on `unet`'s eligible Linears; returns {path: (linear, forward)} for `take_off`."""
    out = {}
    for key, patch in plan_fp8(unet, make=A1111Fp8Forward).items():
        path = key[:-len("." + ATTR)]
        linear = patching.get_attr(unet, path)
        linear.__dict__[ATTR] = patch
        out[path] = (linear, patch)
    return out


def take_off(forwards):
    """Deletes the forwards `set_forwards` set (where still ours) and frees their weights' FP8 copies; returns how
    many were taken off."""
    n = 0
    for linear, patch in forwards.values():
        if linear.__dict__.get(ATTR) is patch:
            del linear.__dict__[ATTR]
            n += 1
    weights.drop_copies_of([linear.weight for linear, _ in forwards.values() if linear.weight is not None])
    return n
