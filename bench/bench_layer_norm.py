"""Times torch LayerNorm against the Triton kernel on real SD transformer shapes (GPU only).

    python bench/bench_layer_norm.py [--dtype fp16|bf16|fp32]

Times are eager and CUDA-graph replay (GPU time alone, as a graphed UNet step pays); achieved
bandwidth, from the graph time, counts one read and one write of x. The torch side gets weights
already in x's dtype, as ComfyUI casts them.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_timing import DTYPES, eager_us, graph_us  # noqa: E402  (also registers sd_accel)

import torch  # noqa: E402

from sd_accel.kernels.layer_norm import layer_norm, layer_norm_reference  # noqa: E402

SHAPES = [
    ("sd15", (2, 4096, 320)), ("sd15", (2, 1024, 640)), ("sd15", (2, 256, 1280)),
    ("sd15", (2, 64, 1280)), ("sdxl", (2, 4096, 640)), ("sdxl", (2, 1024, 1280)),
    ("b8", (8, 4096, 320)),
]



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp16", choices=DTYPES)
    dtype = DTYPES[ap.parse_args().dtype]
    torch.manual_seed(0)
    print(f"{'model':5} {'shape':20} {'dtype':9} {'torch us':>9} {'ours us':>9} {'speedup':>7} "
          f"{'torch graph':>11} {'ours graph':>10} {'speedup':>7} {'GB/s':>6} {'max err':>9}")
    for tag, shape in SHAPES:
        D = shape[-1]
        x = torch.randn(shape, device="cuda", dtype=dtype) * 2 + 0.5
        w = torch.randn(D, device="cuda", dtype=dtype)
        b = torch.randn(D, device="cuda", dtype=dtype)
        ours = layer_norm(x, (D,), w, b)
        assert layer_norm.last_path == "triton", layer_norm.last_reason
        err = (ours.float() - layer_norm_reference(x.float(), (D,), w.float(), b.float())).abs().max().item()
        fns = (lambda: layer_norm_reference(x, (D,), w, b), lambda: layer_norm(x, (D,), w, b))
        e_t, e_o = [eager_us(fn) for fn in fns]
        g_t, g_o = [graph_us(fn) for fn in fns]
        gbs = 2 * x.numel() * x.element_size() / (g_o * 1e-6) / 1e9
        print(f"{tag:5} {str(shape):20} {str(dtype)[6:]:9} {e_t:9.1f} {e_o:9.1f} {e_t / e_o:6.2f}x "
              f"{g_t:11.1f} {g_o:10.1f} {g_t / g_o:6.2f}x {gbs:6.0f} {err:9.2e}")


if __name__ == "__main__":
    main()
