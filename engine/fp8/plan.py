"""Which modules compute in FP8 (precision "fp8"): the feed-forward's GEGLU projection of every transformer block
(`ff.net.0.proj`, C -> 8C, the widest GEMM of the block and a third of an SDXL step's FLOPs), where the GEGLU
that follows runs in the FP8 GEMM's epilogue (kernels/fp8_gemm.py), so its [tokens, 8C] output is never written.

Every other Linear stays fp16: on the H200 (bench/bench_fp8_gemm.py) the per-token quantization of the input
plus an FP8 GEMM is slower than cuBLAS's fp16 GEMM for attention's q/k/v/out projections (C -> C), the
feed-forward's output (4C -> C) and proj_in/proj_out, whose GEMMs are small and whose outputs are not fused
with anything. Also fp16, as FP8 recipes keep them: convolutions, embeddings, attention's softmax path.
"""
from torch import nn

from ..patches.forward_patches import path_of
from . import gemm
from .linear import make_fp8_linear

_FP8_LINEARS = (".ff.net.0.proj",)     # GEGLU's projection (ComfyUI's and ldm's FeedForward)


def plan_fp8(root, prefix="", make=make_fp8_linear):
    """{prefix + path + ".forward": FP8 forward patch (`make(linear)`)} for the eligible Linear layers under `root`
    (never modified)."""
    out = {}
    for name, mod in root.named_modules():
        if not isinstance(mod, nn.Linear) or not ("." + name).endswith(_FP8_LINEARS) \
                or ".transformer_blocks." not in "." + name:
            continue
        if gemm.shapes_refusal(mod.in_features, mod.out_features):
            continue
        out[path_of(prefix + name)] = make(mod)
    return out
