"""Times torch LayerNorm against the Triton kernel on real SD transformer shapes (GPU only).

    python bench/bench_layer_norm.py [--dtype fp16|bf16|fp32] [--out DIR]

Times are eager and CUDA-graph replay (kernel_timing.py); achieved bandwidth, from the graph time, counts
one read and one write of x. The torch side gets weights already in x's dtype, as ComfyUI casts them.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_timing import RESIDUAL_STREAM_SHAPES, Case, run  # noqa: E402  (also registers sd_accel)

import torch  # noqa: E402

from sd_accel.kernels.layer_norm import layer_norm, layer_norm_reference  # noqa: E402

SHAPES = RESIDUAL_STREAM_SHAPES


def setup(dtype):
    for tag, shape in SHAPES:
        D = shape[-1]
        x = torch.randn(shape, device="cuda", dtype=dtype) * 2 + 0.5
        w = torch.randn(D, device="cuda", dtype=dtype)
        b = torch.randn(D, device="cuda", dtype=dtype)
        ref = layer_norm_reference(x.float(), (D,), w.float(), b.float())
        err = (layer_norm(x, (D,), w, b).float() - ref).abs().max().item()
        yield Case((tag, shape), lambda x=x, w=w, b=b: layer_norm_reference(x, (x.shape[-1],), w, b),
                   lambda x=x, w=w, b=b: layer_norm(x, (x.shape[-1],), w, b), 2 * x.numel() * x.element_size(), err)


if __name__ == "__main__":
    run(layer_norm, setup, [("model", 5), ("shape", 20)], description=__doc__)
