"""Times torch GEGLU (chunk, erf GELU, mul) against the fused Triton kernel on real SD shapes (GPU only).

    python bench/bench_geglu.py [--dtype fp16|bf16|fp32] [--out DIR]

Times are eager and CUDA-graph replay (kernel_timing.py); achieved bandwidth, from the graph time, counts
one read of h (..., 2D) and one write of the (..., D) output.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_timing import Case, run  # noqa: E402  (also registers sd_accel)

import torch  # noqa: E402

from sd_accel.kernels.geglu import geglu, geglu_reference  # noqa: E402

SHAPES = [
    ("sd15", (2, 4096, 2560)), ("sd15", (2, 1024, 5120)), ("sd15", (2, 256, 10240)),
    ("sd15", (2, 64, 10240)), ("sdxl", (2, 4096, 5120)), ("sdxl", (2, 1024, 10240)),
    ("b8", (8, 4096, 2560)),
]


def setup(dtype):
    for tag, shape in SHAPES:
        h = torch.randn(shape, device="cuda", dtype=dtype) * 2
        err = (geglu(h).float() - geglu_reference(h.float())).abs().max().item()
        yield Case((tag, shape), lambda h=h: geglu_reference(h), lambda h=h: geglu(h),
                   int(1.5 * h.numel() * h.element_size()), err)


if __name__ == "__main__":
    run(geglu, setup, [("model", 5), ("shape", 20)], description=__doc__)
