"""Which modules compute in FP8 (precision "fp8"): the Linear layers of the transformers (attention's q/k/v/out
projections, the feed-forward's GEGLU projection and output, SDXL's Linear proj_in/proj_out), where the
compute of an SDXL step is. Kept in fp16, as FP8 recipes keep them: the first and last convolution, the
timestep and label embeddings, the ResBlocks' embedding projections (a batch-sized GEMM, nothing to gain),
attention's softmax path (its q/k/v are fp16 outputs of the FP8 projections), cross-attention's k/v projections
of the text (`_KEPT_FP16`) and, for now, every convolution (3x3 and SD1.5's 1x1 proj_in/proj_out), which cuDNN
runs in fp16.
"""
from torch import nn

from ..patches.forward_patches import path_of
from . import gemm
from .linear import make_fp8_linear

_TRANSFORMER_PARTS = (".transformer_blocks.", )
_PROJECTIONS = ("proj_in", "proj_out")
# cross-attention's k/v project the text conditioning: 77 tokens a prompt, too few rows for FP8 to pay its
# quantization, and the one input every step shares
_KEPT_FP16 = ("attn2.to_k", "attn2.to_v")


def _in_transformer(name):
    return any(p in "." + name + "." for p in _TRANSFORMER_PARTS) or name.rsplit(".", 1)[-1] in _PROJECTIONS


def plan_fp8(root, prefix=""):
    """{prefix + path + ".forward": FP8 forward patch} for the eligible Linear layers under `root` (never
    modified)."""
    out = {}
    for name, mod in root.named_modules():
        if not name or not isinstance(mod, nn.Linear) or not _in_transformer(name) or name.endswith(_KEPT_FP16):
            continue
        if gemm.shapes_refusal(mod.in_features, mod.out_features):
            continue
        out[path_of(prefix + name)] = make_fp8_linear(mod)
    return out
