"""fp8-stored checkpoints at precision fp16 (lossless): ComfyUI computes with manual cast, upcasting every fp8
weight to fp16 at every call, which costs each step a read of the fp8 weights and a write and read of fp16 ones.
The forward patch here (set as the layer's own forward: engine/patches/forward_patches.py) keeps the upcast fp16
copy (engine/fp8/weights.py: keyed on the weight tensor, so a LoRA or weight patch makes a new one) and computes
with it: the same values ComfyUI's cast gives, without the per-step cast. Planned only where the copies fit in free
VRAM (the host decides); the copies are counted in the report. Where they do not, or the weights are to stay as
stored, `GroupedUpcastForward` casts a group of layers at a time at each step instead (engine/fp8/block_upcast.py).
Where the host computes the weight per call (`weight_function`, `bias_function`: LoRA on a low-VRAM model) or
the weight is elsewhere than the input, the host's own forward runs.
"""
import torch
import torch.nn.functional as F
from torch import nn

from ..patches import emb_projections
from ..patches import fused_modules as fm
from ..patches.forward_patches import ForwardPatch, path_of
from . import block_upcast, weights


class UpcastForward(ForwardPatch):
    sdaccel_kind = "fp8_upcast"
    # where graphs do not run and the eager step takes the stock modules (engine/graphs/eager.py), the layer still
    # reads its kept copy: the host's values, without the host's per-call cast, which made that step slower
    # than stock's own
    on_stock_path = True

    def __init__(self, module):
        super().__init__(module)
        # a layer that computes the plain op only in training mode (fused_modules.computes_plainly_in_training):
        # in eval mode its own forward runs
        self.sdaccel_needs_training = fm.computes_plainly_in_training(module)

    def plain_now(self):
        return not self.sdaccel_needs_training or self.module.training

    def compute(self, x):
        wb = self.sdaccel_weights(x)
        if wb is None:
            return None
        if isinstance(self.module, nn.Conv2d):
            return self.module._conv_forward(x, *wb)
        return F.linear(x, *wb)

    def sdaccel_weights(self, x):
        """(fp16 weight, bias) in x's dtype from the kept copy, or None where the host's cast must run."""
        return weights.kept_upcast(self.module, x) if self.plain_now() else None


class GroupedUpcastForward(UpcastForward):
    """The layer's weight cast with its group's at each step (engine/fp8/block_upcast.py), no copy kept."""
    sdaccel_kind = "fp8_upcast_grouped"

    def __init__(self, module, group):
        super().__init__(module)
        self.group = group

    def sdaccel_weights(self, x):
        return self.group.weights(self.module, x) if self.plain_now() else None

    def sdaccel_bias(self, x):
        """(bias in x's dtype,) without casting the group (a reader of the bias alone: engine/patches/
        emb_projections.py, for every ResBlock at the first), or None where the host must cast it."""
        if not block_upcast.castable(self.module, x) or not self.plain_now():
            return None
        b = self.module.bias
        return (b if b is None or b.dtype == x.dtype else weights.upcast_of(b, x.dtype)[0],)


# what an fp8-stored checkpoint's weights become (the nodes' `fp8_weights`): one fp16 copy each where the GPU has
# room (fastest), or kept as stored and cast a group of layers at a time at each step (the UNet's weights in half
# an fp16 model's VRAM)
MODES = ("fp16 copies", "as stored")


def is_fp8_stored(m):
    """A host Linear/Conv2d whose weight is stored in fp8 and cast per call by the host (manual cast), into the
    plain op (not a layer of a class computing in FP8 or with a checkpoint scale: fused_modules.computes_plainly;
    one that computes in FP8 in eval mode only counts while in training mode, and its patch checks at each call)."""
    w = getattr(m, "weight", None)
    return isinstance(m, (nn.Linear, nn.Conv2d)) and w is not None and w.dtype in weights.FP8_DTYPES and \
        bool(getattr(m, "comfy_cast_weights", False)) and \
        (fm.computes_plainly(m) or (m.training and fm.computes_plainly_in_training(m)))


def plan_upcast(root, prefix="", grouped=False):
    """({prefix + path + ".forward": forward patch} for every fp8-stored Linear/Conv2d under `root`, bytes their
    kept fp16 copies take). `grouped`: no copies; each step casts a group at a time instead
    (engine/fp8/block_upcast.py): adjacent layers in the model's order, and the ResBlocks' timestep-embedding
    projections in groups of their own, because a fused ResBlock reads all of them at the first ResBlock
    (engine/patches/emb_projections.py): in a group with their blocks' convolutions, that read would cast
    every ResBlock's group at once."""
    stored = [(name, mod) for name, mod in root.named_modules() if name and is_fp8_stored(mod)]
    if not grouped:
        return ({path_of(prefix + name): UpcastForward(mod) for name, mod in stored},
                sum(mod.weight.numel() * 2 for _, mod in stored))
    read_together = {id(blk.emb_layers[1]) for blk in root.modules() if emb_projections.batchable(blk)}
    names = {id(mod): name for name, mod in stored}
    out = {}
    for run in ([m for _, m in stored if id(m) not in read_together], [m for _, m in stored if id(m) in read_together]):
        for group in block_upcast.plan_groups(run):
            for mod in group.modules:
                out[path_of(prefix + names[id(mod)])] = GroupedUpcastForward(mod, group)
    return out, 0
