"""PyTorch SDPA's backends on the attention calls of real SD steps (CFG batch 2, fp16), in ComfyUI's layout
(q, k, v: [B, tokens, heads x dim] viewed as [B, heads, tokens, dim]), CUDA-graph replay times. GPU only.

    python bench/bench_attention.py [--out DIR]

Which backend PyTorch picks by itself ("default") against each one forced (cuDNN, flash, memory-efficient),
and the largest difference from the math backend's fp32 result. Nothing for results.jsonl (a kernel sweep).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_timing import graph_us, save_lines  # noqa: E402  (also registers sd_accel)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

# (tag, batch, heads, query tokens, key tokens, head dim)
CALLS = [
    ("sd15_512 self l1", 2, 8, 4096, 4096, 40), ("sd15_512 cross l1", 2, 8, 4096, 77, 40),
    ("sd15_512 self l2", 2, 8, 1024, 1024, 80), ("sd15_512 self l3", 2, 8, 256, 256, 160),
    ("sd15_768 self l1", 2, 8, 9216, 9216, 40), ("sd15_768 self l2", 2, 8, 2304, 2304, 80),
    ("sdxl self l2", 2, 10, 4096, 4096, 64), ("sdxl self l3", 2, 20, 1024, 1024, 64),
    ("sdxl cross l3", 2, 20, 1024, 77, 64), ("sd15_512_b4 self l1", 8, 8, 4096, 4096, 40),
]
BACKENDS = [("default", None), ("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION)]


def comfy_layout(b, n, h, d):
    t = torch.randn(b, n, h * d, device="cuda", dtype=torch.float16)
    return t.view(b, n, h, d).transpose(1, 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    opt = ap.parse_args()
    torch.manual_seed(0)
    lines = []
    head = "%-20s %-22s" % ("call", "shape") + "".join("%12s" % n for n, _ in BACKENDS) + "   best    max err (best)"
    print(head, flush=True)
    lines.append(head)
    for tag, b, h, nq, nk, d in CALLS:
        q, k, v = comfy_layout(b, nq, h, d), comfy_layout(b, nk, h, d), comfy_layout(b, nk, h, d)
        with sdpa_kernel([SDPBackend.MATH]):
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        times, errs = {}, {}
        for name, be in BACKENDS:
            def call(be=be):
                if be is None:
                    return F.scaled_dot_product_attention(q, k, v)
                with sdpa_kernel([be]):
                    return F.scaled_dot_product_attention(q, k, v)
            try:
                errs[name] = (call().float() - ref).abs().max().item()
                times[name] = graph_us(call)
            except Exception as e:  # noqa: BLE001 - a backend that does not take this shape
                times[name] = None
                print("  %s %s: %s" % (tag, name, str(e).splitlines()[0][:100]), flush=True)
        best = min((t, n) for n, t in times.items() if t is not None)
        row = "%-20s %-22s" % (tag, "%dx%dx%dx%d (k %d)" % (b, h, nq, d, nk)) + "".join(
            "%12s" % ("%.1f" % times[n] if times[n] is not None else "-") for n, _ in BACKENDS) + \
            "   %-9s %.1e" % (best[1], errs[best[1]])
        print(row, flush=True)
        lines.append(row)
    save_lines(opt.out, "attention.txt", lines)


if __name__ == "__main__":
    main()
