"""Times a transformer block's residual add then LayerNorm, torch's two kernels against the fused Triton
pass, on real SD transformer shapes (GPU only).

    python bench/bench_add_layer_norm.py [--dtype fp16|bf16|fp32] [--out DIR]

torch: `s = a + r` then `F.layer_norm(s)` (the add's kernel writes s, the norm's reads it back); ours:
`add_layer_norm(a, r, ...)`, as the transformer block stand-in calls it. Times are eager and CUDA-graph
replay (kernel_timing.py); achieved bandwidth, from the graph time, counts the fused pass's two reads (a,
r) and two writes (s and the norm). The torch side gets weights already in the inputs' dtype, as ComfyUI
casts them.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_timing import RESIDUAL_STREAM_SHAPES, Case, run  # noqa: E402  (also registers sd_accel)

import torch  # noqa: E402

from sd_accel.kernels.add_layer_norm import add_layer_norm, add_layer_norm_reference  # noqa: E402

SHAPES = RESIDUAL_STREAM_SHAPES


def setup(dtype):
    for tag, shape in SHAPES:
        D = shape[-1]
        a = torch.randn(shape, device="cuda", dtype=dtype) * 2 + 0.5
        r = torch.randn(shape, device="cuda", dtype=dtype) * 4
        w = torch.randn(D, device="cuda", dtype=dtype)
        b = torch.randn(D, device="cuda", dtype=dtype)
        s_ref, y_ref = add_layer_norm_reference(a.float(), r.float(), (D,), w.float(), b.float())
        s, y = add_layer_norm(a, r, (D,), w, b)
        err = max((s.float() - s_ref).abs().max().item(), (y.float() - y_ref).abs().max().item())
        yield Case((tag, shape), lambda a=a, r=r, w=w, b=b: add_layer_norm_reference(a, r, (a.shape[-1],), w, b),
                   lambda a=a, r=r, w=w, b=b: add_layer_norm(a, r, (a.shape[-1],), w, b),
                   4 * a.numel() * a.element_size(), err)


if __name__ == "__main__":
    run(add_layer_norm, setup, [("model", 5), ("shape", 20)], description=__doc__)
