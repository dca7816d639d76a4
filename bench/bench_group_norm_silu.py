"""Times torch GroupNorm + SiLU against the fused Triton kernels on real SD shapes (GPU only).

    python bench/bench_group_norm_silu.py [--dtype fp16|bf16|fp32] [--out DIR]

Prints shape, layout, dtype, torch and fused median times called eagerly and replayed from a CUDA graph
(kernel_timing.py), the speedups, the fused op's achieved bandwidth in the graph counting one read and one
write of x, and the max abs error against the fp32 reference. The torch side gets weights already in x's
dtype, as ComfyUI casts them. `plan` is the Triton path the sizes pick (`1prog`: one launch, one program per
(sample, group); `split`: statistics + apply, two launches); for `1prog` shapes, `split graph` is the split
path forced on the same call, the comparison that tunes `ONE_TILE_MAX` (kernels/_group_norm_tiling.py).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_timing import Case, graph_us, run  # noqa: E402  (also registers sd_accel)

import torch  # noqa: E402

from sd_accel.kernels import _group_norm_tiling as tiling  # noqa: E402
from sd_accel.kernels.group_norm_silu import group_norm_silu, group_norm_silu_reference  # noqa: E402

SHAPES = [
    ("sd15", (2, 320, 64, 64)), ("sd15", (2, 640, 32, 32)), ("sd15", (2, 1280, 16, 16)),
    ("sd15", (2, 1280, 8, 8)), ("sd15", (2, 960, 64, 64)), ("sd15", (2, 2560, 8, 8)),
    ("sd15", (2, 320, 32, 32)), ("sd15", (2, 960, 32, 32)), ("sd15", (2, 1920, 32, 32)),
    ("sd15", (2, 1920, 16, 16)), ("sd15", (2, 2560, 16, 16)),
    ("sdxl", (2, 320, 128, 128)), ("sdxl", (2, 640, 64, 64)), ("sdxl", (2, 1280, 32, 32)),
    ("b8", (8, 320, 64, 64)), ("b8", (8, 320, 128, 128)),
]


def _split_graph_us(fused):
    """The split path's graph time on a call that picks one program per group."""
    keep, tiling.ONE_TILE_MAX = tiling.ONE_TILE_MAX, 0
    try:
        return f"{graph_us(fused):.1f}"
    finally:
        tiling.ONE_TILE_MAX = keep


def setup(dtype):
    for tag, shape in SHAPES:
        for layout in ("nchw", "cl"):
            x = torch.randn(shape, device="cuda", dtype=dtype) * 2 + 0.5
            if layout == "cl":
                x = x.to(memory_format=torch.channels_last)
            w = torch.randn(shape[1], device="cuda", dtype=dtype)
            b = torch.randn(shape[1], device="cuda", dtype=dtype)
            ours = group_norm_silu(x, 32, w, b)
            plan = "1prog" if group_norm_silu.last_call.plan == "one program per group" else "split"
            ref = group_norm_silu_reference(x.float(), 32, w.float(), b.float())
            err = (ours.float() - ref).abs().max().item()
            fused = lambda x=x, w=w, b=b: group_norm_silu(x, 32, w, b)  # noqa: E731
            split = _split_graph_us(fused) if plan == "1prog" else "-"
            yield Case((tag, shape, layout), lambda x=x, w=w, b=b: group_norm_silu_reference(x, 32, w, b), fused,
                       2 * x.numel() * x.element_size(), err, (plan, split))


if __name__ == "__main__":
    run(group_norm_silu, setup, [("model", 5), ("shape", 20), ("layout", 6)], [("plan", 5), ("split graph", 11)],
        description=__doc__)
