"""Attention projections one GEMM each (ComfyUI's CrossAttention: to_q, to_k, to_v) against one GEMM over the
concatenated weights (self-attention: q, k and v from one [dim, 3 dim] product; cross-attention: k and v from
one [context dim, 2 dim] product), each followed by PyTorch SDPA on the slices in ComfyUI's layout, on every
attention site of an SD1.5 / SDXL step, CUDA-graph replay times. GPU only; a kernel sweep that decides whether
a fused-projection stand-in is worth building, nothing for results.jsonl.

    python bench/bench_qkv.py [--out DIR]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_timing import graph_us, save_lines  # noqa: E402  (also registers sd_accel)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# (tag, batch, tokens, dim, heads, context tokens, context dim, sites per step)
SITES = [
    ("sd15_512 l1", 2, 4096, 320, 8, 77, 768, 5), ("sd15_512 l2", 2, 1024, 640, 8, 77, 768, 5),
    ("sd15_512 l3", 2, 256, 1280, 8, 77, 768, 5), ("sd15_512 mid", 2, 64, 1280, 8, 77, 768, 1),
    ("sd15_512_b4 l1", 8, 4096, 320, 8, 77, 768, 5), ("sd15_512_b4 l2", 8, 1024, 640, 8, 77, 768, 5),
    ("sd15_512_b4 l3", 8, 256, 1280, 8, 77, 768, 5), ("sd15_512_b4 mid", 8, 64, 1280, 8, 77, 768, 1),
    ("sd15_768 l1", 2, 9216, 320, 8, 77, 768, 5), ("sd15_768 l2", 2, 2304, 640, 8, 77, 768, 5),
    ("sd15_768 l3", 2, 576, 1280, 8, 77, 768, 5), ("sd15_768 mid", 2, 144, 1280, 8, 77, 768, 1),
    ("sdxl l2", 2, 4096, 640, 10, 77, 2048, 4), ("sdxl l3", 2, 1024, 1280, 20, 77, 2048, 30),
    ("sdxl mid", 2, 1024, 1280, 20, 77, 2048, 10),
]


def attention(q, k, v, heads):
    b, d = q.shape[0], q.shape[-1] // heads
    q, k, v = (t.view(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, heads * d)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    opt = ap.parse_args()
    torch.manual_seed(0)
    h16 = dict(device="cuda", dtype=torch.float16)
    lines = ["%-16s %9s %9s %7s %9s %9s %7s %10s %9s" % ("site", "self us", "fused", "x", "cross us", "fused", "x",
                                                          "saved/step", "max diff")]
    print(lines[0], flush=True)
    total = {}
    for tag, b, n, dim, heads, cn, cdim, count in SITES:
        x = torch.randn(b, n, dim, **h16)
        ctx = torch.randn(b, cn, cdim, **h16)
        wq, wk, wv = (torch.randn(dim, dim, **h16) / dim ** 0.5 for _ in range(3))
        cq, ck, cv = torch.randn(dim, dim, **h16) / dim ** 0.5, *(torch.randn(dim, cdim, **h16) / cdim ** 0.5
                                                                 for _ in range(2))
        wqkv, ckv = torch.cat([wq, wk, wv]), torch.cat([ck, cv])

        def self_sep():
            return attention(F.linear(x, wq), F.linear(x, wk), F.linear(x, wv), heads)

        def self_fused():
            return attention(*F.linear(x, wqkv).split(dim, dim=-1), heads)

        def cross_sep():
            return attention(F.linear(x, cq), F.linear(ctx, ck), F.linear(ctx, cv), heads)

        def cross_fused():
            return attention(F.linear(x, cq), *F.linear(ctx, ckv).split(dim, dim=-1), heads)

        diff = max((self_sep() - self_fused()).abs().max().item(), (cross_sep() - cross_fused()).abs().max().item())
        t = [graph_us(f) for f in (self_sep, self_fused, cross_sep, cross_fused)]
        saved = count * (t[0] - t[1] + t[2] - t[3])
        cfg = tag.split()[0]
        total[cfg] = total.get(cfg, 0.0) + saved
        line = "%-16s %9.1f %9.1f %7.2f %9.1f %9.1f %7.2f %10.1f %9.2g" % (
            tag, t[0], t[1], t[0] / t[1], t[2], t[3], t[2] / t[3], saved, diff)
        print(line, flush=True)
        lines.append(line)
    for cfg, us in total.items():
        line = "%s: fused projections save %.1f us per UNet step" % (cfg, us)
        print(line)
        lines.append(line)
    save_lines(opt.out, "qkv.txt", lines)


if __name__ == "__main__":
    main()
