"""Times torch GroupNorm + SiLU against the fused Triton kernels on real SD shapes (GPU only).

    python bench/bench_group_norm_silu.py [--dtype fp16|bf16|fp32]

Prints shape, layout, dtype, torch and fused median times (triton.testing.do_bench) called eagerly
and replayed from a CUDA graph (GPU time alone, as a graphed UNet step pays), the speedups, the fused
op's achieved bandwidth in the graph counting one read and one write of x, and the max abs error
against the fp32 reference. The torch side gets weights already in x's dtype, as ComfyUI casts them.
`plan` is the Triton path the sizes pick (`1prog`: one launch, one program per (sample, group);
`split`: statistics + apply, two launches); for `1prog` shapes, `split graph` is the split path forced
on the same call, the comparison that tunes `_ONE_TILE_MAX`.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_timing import DTYPES, eager_us, graph_us  # noqa: E402  (also registers sd_accel)

import torch  # noqa: E402

from sd_accel.kernels import group_norm_silu as gn  # noqa: E402
from sd_accel.kernels.group_norm_silu import group_norm_silu, group_norm_silu_reference  # noqa: E402

SHAPES = [
    ("sd15", (2, 320, 64, 64)), ("sd15", (2, 640, 32, 32)), ("sd15", (2, 1280, 16, 16)),
    ("sd15", (2, 1280, 8, 8)), ("sd15", (2, 960, 64, 64)), ("sd15", (2, 2560, 8, 8)),
    ("sd15", (2, 320, 32, 32)), ("sd15", (2, 960, 32, 32)), ("sd15", (2, 1920, 32, 32)),
    ("sd15", (2, 1920, 16, 16)), ("sd15", (2, 2560, 16, 16)),
    ("sdxl", (2, 320, 128, 128)), ("sdxl", (2, 640, 64, 64)), ("sdxl", (2, 1280, 32, 32)),
    ("b8", (8, 320, 64, 64)), ("b8", (8, 320, 128, 128)),
]



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp16", choices=DTYPES)
    dtype = DTYPES[ap.parse_args().dtype]
    torch.manual_seed(0)
    print(f"{'model':5} {'shape':20} {'layout':6} {'dtype':9} {'torch us':>9} {'ours us':>9} {'speedup':>7} "
          f"{'torch graph':>11} {'ours graph':>10} {'speedup':>7} {'GB/s':>6} {'max err':>9} {'plan':>5} "
          f"{'split graph':>11}")
    for tag, shape in SHAPES:
        for layout in ("nchw", "cl"):
            x = torch.randn(shape, device="cuda", dtype=dtype) * 2 + 0.5
            if layout == "cl":
                x = x.to(memory_format=torch.channels_last)
            w = torch.randn(shape[1], device="cuda", dtype=dtype)
            b = torch.randn(shape[1], device="cuda", dtype=dtype)
            ours = group_norm_silu(x, 32, w, b)
            assert group_norm_silu.last_path == "triton", group_norm_silu.last_reason
            plan = "1prog" if group_norm_silu.last_plan == "one program per group" else "split"
            ref = group_norm_silu_reference(x.float(), 32, w.float(), b.float())
            err = (ours.float() - ref).abs().max().item()
            fns = (lambda: group_norm_silu_reference(x, 32, w, b), lambda: group_norm_silu(x, 32, w, b))
            e_t, e_o = [eager_us(fn) for fn in fns]
            g_t, g_o = [graph_us(fn) for fn in fns]
            gbs = 2 * x.numel() * x.element_size() / (g_o * 1e-6) / 1e9
            split = "-"
            if plan == "1prog":
                keep, gn._ONE_TILE_MAX = gn._ONE_TILE_MAX, 0
                try:
                    split = f"{graph_us(fns[1]):.1f}"
                finally:
                    gn._ONE_TILE_MAX = keep
            print(f"{tag:5} {str(shape):20} {layout:6} {str(dtype)[6:]:9} {e_t:9.1f} {e_o:9.1f} "
                  f"{e_t / e_o:6.2f}x {g_t:11.1f} {g_o:10.1f} {g_t / g_o:6.2f}x {gbs:6.0f} {err:9.2e} {plan:>5} "
                  f"{split:>11}")


if __name__ == "__main__":
    main()
