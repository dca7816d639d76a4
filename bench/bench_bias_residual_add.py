"""Times the end of a ResBlock, torch's way against the fused Triton pass, on SD1.5 shapes (GPU only).

    python bench/bench_bias_residual_add.py [--dtype fp16|bf16|fp32] [--out DIR]

torch: the conv output plus its bias (the broadcast add cuDNN's convolution leaves to torch), then
`residual + h`; ours: `bias_residual_add(h, residual, bias, out=h)` as the ResBlock stand-in calls it.
Prints shape, layout, dtype, median times called eagerly and replayed from a CUDA graph (kernel_timing.py),
the speed-ups, the fused op's bandwidth in the graph (two reads and one write), and the max abs error
against the fp32 reference. Both sides run in place on one buffer, so its values drift over the
repetitions; only the times matter there, the error is taken first.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_timing import Case, run  # noqa: E402  (also registers sd_accel)

import torch  # noqa: E402

from sd_accel.kernels.bias_residual_add import bias_residual_add, bias_residual_add_reference  # noqa: E402

# SD1.5 ResBlock outputs, CFG batch 2 at 512² and batch 8 (CFG batch 4)
SHAPES = [(2, 320, 64, 64), (2, 640, 32, 32), (2, 1280, 16, 16), (2, 1280, 8, 8), (8, 320, 64, 64)]


def setup(dtype):
    for shape in SHAPES:
        for layout in ("nchw", "cl"):
            fmt = torch.channels_last if layout == "cl" else torch.contiguous_format
            h = torch.randn(shape, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
            r = torch.randn(shape, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
            b = torch.randn(shape[1], device="cuda", dtype=dtype)
            work = h.clone()
            ours = bias_residual_add(work, r, b)
            err = (ours.float() - bias_residual_add_reference(h.float(), r.float(), b.float())).abs().max().item()

            def stock(work=work, r=r, b=b):   # torch's two passes over the conv output: its bias, in place, then
                return r + work.add_(b.view(1, -1, 1, 1))
            yield Case((shape, layout), stock, lambda work=work, r=r, b=b: bias_residual_add(work, r, b, out=work),
                       3 * h.numel() * h.element_size(), err)


if __name__ == "__main__":
    run(bias_residual_add, setup, [("shape", 20), ("layout", 6)], description=__doc__)
