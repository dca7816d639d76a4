"""Times ComfyUI's way of computing with fp8-stored weights (each layer's weight cast to fp16 by a `.to()` of its
own, one copy kernel a layer) against one upcast_fp8 kernel for a group of them (GPU only).

    python bench/bench_upcast_fp8.py [--dtype fp16|bf16|fp32] [--out DIR]

Groups of the weight shapes of SD1.5's and SDXL's UNet layers, as engine/fp8/block_upcast.py forms them (adjacent
layers, up to 64 MiB of fp16). Times are eager and CUDA-graph replay (kernel_timing.py); bandwidth counts one read
of the fp8 weights and one write of the cast copies. `--sweep` then times the kernel's tile and warps on the largest
group (CUDA-graph replay), for its constants.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_timing import Case, run  # noqa: E402  (also registers sd_accel)

import torch  # noqa: E402

from sd_accel.kernels import upcast_fp8 as k  # noqa: E402


def _transformer_block(c, ctx):
    """A BasicTransformerBlock's Linears: attn1 q k v out, attn2 q k v out, GEGLU projection, feed-forward out."""
    return [(c, c)] * 4 + [(c, c), (c, ctx), (c, ctx), (c, c), (8 * c, c), (c, 4 * c)]


def _resblock(c_in, c):
    return [(c, c_in, 3, 3), (c, 1280), (c, c, 3, 3)] + ([(c, c_in, 1, 1)] if c_in != c else [])


GROUPS = [
    ("sd15 resblock", 320, _resblock(320, 320)),
    ("sd15 transformer", 320, [(320, 320, 1, 1)] + _transformer_block(320, 768) + [(320, 320, 1, 1)]),
    ("sd15 resblock", 1280, _resblock(1280, 1280)),
    ("sd15 transformer", 1280, [(1280, 1280, 1, 1)] + _transformer_block(1280, 768) + [(1280, 1280, 1, 1)]),
    ("sdxl 2 transformer blocks", 640, _transformer_block(640, 2048) * 2),
    ("sdxl 3 transformer blocks", 1280, _transformer_block(1280, 2048) * 3),
]


def setup(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    for tag, width, shapes in GROUPS:
        sources = [(torch.randn(s, device="cuda", generator=g) * 0.05).to(torch.float8_e4m3fn) for s in shapes]
        sources = [t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t for t in sources]
        layout = k.Layout([t.numel() for t in sources], "cuda")
        pointers = k.pointer_table(sources, "cuda")

        def ours(sources=sources, layout=layout, pointers=pointers):
            return k.upcast_fp8(sources, torch.empty(layout.total, dtype=dtype, device="cuda"), layout, pointers)

        def comfy(sources=sources):
            return [t.to(dtype) for t in sources]

        dst = ours()
        err = max((layout.view(dst, i, t) - t.to(dtype)).abs().max().item() for i, t in enumerate(sources))
        n = sum(t.numel() for t in sources)
        yield Case((tag, width, len(sources), "%.1f" % (2 * n / 2 ** 20)), comfy, ours,
                   n * (1 + torch.finfo(dtype).bits // 8), err)


def sweep():
    from kernel_timing import graph_us
    tag, width, shapes = GROUPS[-1]
    sources = [(torch.randn(s, device="cuda") * 0.05).to(torch.float8_e4m3fn) for s in shapes]
    n = sum(t.numel() for t in sources)
    print("sweep on %s %d (%d layers): block warps us GB/s" % (tag, width, len(sources)))
    warps0 = k.NUM_WARPS
    for block in (1024, 2048, 4096, 8192, 16384):
        layout = k.Layout([t.numel() for t in sources], "cuda", block=block)
        pointers = k.pointer_table(sources, "cuda")
        dst = torch.empty(layout.total, dtype=torch.float16, device="cuda")
        for warps in (2, 4, 8, 16):
            k.NUM_WARPS = warps
            us = graph_us(lambda: k.upcast_fp8(sources, dst, layout, pointers))
            print("%6d %3d %8.1f %6.0f" % (block, warps, us, 3 * n / (us * 1e-6) / 1e9), flush=True)
    k.NUM_WARPS = warps0


if __name__ == "__main__":
    swept = "--sweep" in sys.argv
    if swept:
        sys.argv.remove("--sweep")
    run(k.upcast_fp8, setup, [("group", 26), ("width", 6), ("layers", 7), ("fp16 MiB", 9)], description=__doc__)
    if swept:
        sweep()
