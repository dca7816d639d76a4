"""Every ResBlock's timestep-embedding projection of one UNet (or ControlNet) in one GEMM per forward.

Each ResBlock computes `emb_layers(emb)` = Linear(SiLU(emb)) from the same `emb` and, in the fused ResBlock
(engine/patches/fused_resblock.py), adds its first conv's bias in fp32: SiLU, GEMM, two casts and an add, five
launches of tiny kernels per ResBlock (110 per SD1.5 step, in a graph of 6.3 ms on the H200 whose 870 kernels
leave ~0.34 ms of gaps between them: bench/RESULTS.md, the `profile_step.py` diagnosis of SD1.5 512² b1 with
"870 kernels per step"). Here the first ResBlock that sees a new `emb` computes them for all of the
model's ResBlocks at once: one SiLU, the Linear weights and biases concatenated (read through the host's
casting, so LoRA and low-VRAM casting apply), one GEMM with the bias in cuBLAS's epilogue, one cast, one
add of the concatenated conv biases. Each ResBlock then reads its columns in place (the GroupNorm kernel
takes the row stride). Same arithmetic as the per-block path: each output is the same dot product plus
bias rounded to the weights' dtype, then the conv bias added in fp32.

The result lives on the `emb` tensor itself (a Python attribute), so it is freed with it at the end of the
forward, and a later forward (a new `emb` object) never sees an old one; inside a CUDA graph capture it is
one more intermediate of the captured forward.

Per-block path instead (`projection` returns None) where the batch could read a weight that is not there
yet: while a block streamer holds the model's weights in its GPU ring (engine/memory/offload.py: a block's
weights arrive only when the block runs), or when a ResBlock's `emb_layers` is not exactly [SiLU, Linear].
"""
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from . import fused_modules as fm
from ..memory import residency


# Classes computing F.linear(x, weight, bias) from their `weight` and `bias` as `weights_of` reads them: torch's,
# and a host's own that is not an nn.Linear (Forge's, added by hosts/forge_plan.py after reading its forward)
LINEAR_CLASSES = [nn.Linear]


def register_linear(cls):
    if cls not in LINEAR_CLASSES:
        LINEAR_CLASSES.append(cls)


def batchable(block):
    """A ResBlock whose `emb_layers` is exactly [SiLU, Linear] and whose first conv is the last of `in_layers`, both
    computed by the host as the plain op over their weights (not a scaled-fp8 or FP8-compute Linear; one that
    computes in FP8 in eval mode only is batched while it is in training mode: `EmbProjections.projection`)."""
    emb_layers = getattr(block, "emb_layers", None)
    if not (isinstance(emb_layers, nn.Sequential) and len(emb_layers) == 2):
        return False
    act, lin = emb_layers[0], emb_layers[1]
    conv = block.in_layers[len(block.in_layers) - 1]
    return (isinstance(act, nn.SiLU) and not isinstance(act, fm.SiLUFolded)
            and isinstance(lin, tuple(LINEAR_CLASSES)) and isinstance(conv, nn.Conv2d)
            and (fm.computes_plainly(lin) or fm.computes_plainly_in_training(lin)) and fm.computes_plainly(conv))


class EmbProjections:
    """The shared projection of `blocks` (fused ResBlock stand-ins of the module `root`)."""

    def __init__(self, root, blocks):
        self.root = weakref.ref(root)
        self.blocks = [b for b in blocks if batchable(b)]
        self.index = {id(b): i for i, b in enumerate(self.blocks)}
        self.attr = "_sd_accel_emb_projections_%x" % id(self)
        widths = [b.emb_layers[1].out_features for b in self.blocks]
        self.offsets = [sum(widths[:i]) for i in range(len(widths) + 1)]
        # Linears that compute the plain op only in training mode (ComfyUI's fp8_ops: FP8 multiplies in eval mode):
        # in eval mode every block computes its own, through the layer's forward
        self.in_training_only = [b.emb_layers[1] for b in self.blocks if not fm.computes_plainly(b.emb_layers[1])]

    def projection(self, block, emb):
        """fp32 [N, C] (a column slice): `block`'s emb_layers(emb) + its first conv's bias, or None when the
        block is to compute its own."""
        i = self.index.get(id(block))
        if i is None or len(self.blocks) < 2:
            return None
        done = emb.__dict__.get(self.attr)
        if done is None:
            root = self.root()
            if root is None or residency.token_of(root) is not None or \
                    not all(lin.training for lin in self.in_training_only):
                return None
            done = self._all(emb)
            setattr(emb, self.attr, done)
        return done[:, self.offsets[i]:self.offsets[i + 1]]

    def _all(self, emb):
        s = F.silu(emb)
        ws, bs, cbs = [], [], []
        for blk in self.blocks:
            lin, conv = blk.emb_layers[1], blk.in_layers[len(blk.in_layers) - 1]
            w, b = fm.weights_of(lin, s)
            ws.append(w)
            bs.append(b if b is not None else s.new_zeros(w.shape[0]))
            cb = fm.bias_of(conv, s)
            cbs.append(cb if cb is not None else s.new_zeros(w.shape[0]))
        out = F.linear(s, torch.cat(ws), torch.cat(bs))
        return out.float() + torch.cat(cbs).float()


def attach(root, standins):
    """One EmbProjections for the fused ResBlock stand-ins `standins` of `root`, set on each of them."""
    shared = EmbProjections(root, standins)
    for s in standins:
        s.sdaccel_emb_projections = shared
    return shared
