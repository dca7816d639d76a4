"""Times the end of a ResBlock, torch's way against the fused Triton pass, on SD1.5 shapes (GPU only).

    python bench/bench_bias_residual_add.py [--dtype fp16|bf16|fp32]

torch: the conv output plus its bias (the broadcast add cuDNN's convolution leaves to torch), then
`residual + h`; ours: `bias_residual_add(h, residual, bias, out=h)` as the ResBlock stand-in calls it.
Prints shape, layout, dtype, median times called eagerly and replayed from a CUDA graph (GPU time
alone, as a graphed UNet step pays), the speed-ups, the fused op's bandwidth in the graph (two reads and
one write), and the max abs error against the fp32 reference. Both sides run in place on one buffer, so
its values drift over the repetitions; only the times matter there, the error is taken first.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_timing import DTYPES, eager_us, graph_us  # noqa: E402  (also registers sd_accel)

import torch  # noqa: E402

from sd_accel.kernels.bias_residual_add import bias_residual_add, bias_residual_add_reference  # noqa: E402

# SD1.5 ResBlock outputs, CFG batch 2 at 512² and batch 8 (CFG batch 4)
SHAPES = [(2, 320, 64, 64), (2, 640, 32, 32), (2, 1280, 16, 16), (2, 1280, 8, 8), (8, 320, 64, 64)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp16", choices=DTYPES)
    dtype = DTYPES[ap.parse_args().dtype]
    torch.manual_seed(0)
    print(f"{'shape':20} {'layout':6} {'dtype':9} {'torch us':>9} {'ours us':>9} {'speedup':>7} "
          f"{'torch graph':>11} {'ours graph':>10} {'speedup':>7} {'GB/s':>6} {'max err':>9}")
    for shape in SHAPES:
        for layout in ("nchw", "cl"):
            fmt = torch.channels_last if layout == "cl" else torch.contiguous_format
            h = torch.randn(shape, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
            r = torch.randn(shape, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
            b = torch.randn(shape[1], device="cuda", dtype=dtype)
            work = h.clone()
            ours = bias_residual_add(work, r, b)
            assert bias_residual_add.last_path == "triton", bias_residual_add.last_reason
            err = (ours.float() - bias_residual_add_reference(h.float(), r.float(), b.float())).abs().max().item()

            def stock():   # torch's two passes over the conv output: its bias in place, then the residual
                return r + work.add_(b.view(1, -1, 1, 1))
            fns = (stock, lambda: bias_residual_add(work, r, b, out=work))
            e_t, e_o = [eager_us(fn) for fn in fns]
            g_t, g_o = [graph_us(fn) for fn in fns]
            gbs = 3 * h.numel() * h.element_size() / (g_o * 1e-6) / 1e9
            print(f"{str(shape):20} {layout:6} {str(dtype)[6:]:9} {e_t:9.1f} {e_o:9.1f} {e_t / e_o:6.2f}x "
                  f"{g_t:11.1f} {g_o:10.1f} {g_t / g_o:6.2f}x {gbs:6.0f} {err:9.2e}")


if __name__ == "__main__":
    main()
