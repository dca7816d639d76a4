"""Times torch's per-row FP8 quantization (amax, divide, clamp, cast) against the fused Triton kernel on the
activations the FP8 Linears quantize (GPU only; sm_89/sm_90 for the float8 cast to be native).

    python bench/bench_quantize_rows.py [--dtype fp16|bf16|fp32] [--out DIR]

Times are eager and CUDA-graph replay (kernel_timing.py); achieved bandwidth, from the graph time, counts two
reads of x (the kernel's two passes) and one write of the fp8 copy.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_timing import Case, run  # noqa: E402  (also registers sd_accel)

import torch  # noqa: E402

from sd_accel.kernels.quantize_rows import quantize_rows, quantize_rows_reference  # noqa: E402

# (tokens of the CFG batch, in features) of the transformers' Linears: SD1.5 512² at its three widths, SDXL 1024²
SHAPES = [
    ("sd15", (8192, 320)), ("sd15", (2048, 640)), ("sd15", (512, 1280)), ("sd15 ff", (8192, 1280)),
    ("sdxl", (8192, 640)), ("sdxl", (2048, 1280)), ("sdxl ff", (8192, 2560)),
]


def setup(dtype):
    for tag, shape in SHAPES:
        x = torch.randn(shape, device="cuda", dtype=dtype)
        q, s = quantize_rows(x)
        rq, rs = quantize_rows_reference(x)
        err = (q.float() * s - rq.float() * rs).abs().max().item()
        yield Case((tag, shape), lambda x=x: quantize_rows_reference(x), lambda x=x: quantize_rows(x),
                   int(2 * x.numel() * x.element_size() + x.numel()), err)


if __name__ == "__main__":
    run(quantize_rows, setup, [("model", 8), ("shape", 18)], description=__doc__)
