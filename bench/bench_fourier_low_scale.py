"""Times FreeU's skip filter, torch's way against the two fused passes, on the skips FreeU filters (GPU only).

    python bench/bench_fourier_low_scale.py [--dtype fp16|bf16|fp32] [--out DIR]

torch: the filter as FreeU defines it (`fourier_low_scale_reference`: an fp32 FFT of each plane, the centred window
of the shifted spectrum scaled, the inverse FFT's real part); ours: `fourier_low_scale(x, 1, s)` as FreeU's closures
call it on accelerated runs. Prints shape, layout, dtype, median times called eagerly and replayed from a CUDA graph
(kernel_timing.py), the speed-ups, the fused passes' bandwidth in the graph (two reads and one write) and the max
abs error against the reference on the fp32 input.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_timing import Case, run  # noqa: E402  (also registers sd_accel)

import torch  # noqa: E402

from sd_accel.kernels.fourier_low_scale import fourier_low_scale, fourier_low_scale_reference  # noqa: E402

# the skips FreeU_V2 filters: SD1.5 at 512² and SDXL at 1024², CFG batch 2
SHAPES = [("sd15", (2, 1280, 16, 16)), ("sd15", (2, 640, 32, 32)), ("sd15", (2, 320, 64, 64)),
          ("sdxl", (2, 1280, 32, 32)), ("sdxl", (2, 640, 64, 64)), ("sdxl", (2, 320, 128, 128))]


def setup(dtype):
    for model, shape in SHAPES:
        for layout in ("nchw", "cl"):
            fmt = torch.channels_last if layout == "cl" else torch.contiguous_format
            x = (torch.randn(shape, device="cuda") + torch.randn(shape[:2] + (1, 1), device="cuda")).to(dtype)
            x = x.contiguous(memory_format=fmt)
            ours = fourier_low_scale(x, 1, 0.2)
            err = (ours.float() - fourier_low_scale_reference(x.float(), 1, 0.2)).abs().max().item()
            yield Case((model, shape, layout), lambda x=x: fourier_low_scale_reference(x, 1, 0.2),
                       lambda x=x: fourier_low_scale(x, 1, 0.2), 3 * x.numel() * x.element_size(), err)


if __name__ == "__main__":
    run(fourier_low_scale, setup, [("model", 6), ("shape", 20), ("layout", 6)], description=__doc__)
