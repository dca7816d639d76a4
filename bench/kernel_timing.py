"""Timing helpers shared by the per-op kernel benchmarks (GPU only); importing this also registers
the repo as the package `sd_accel`, whatever its folder is called (as tests/conftest.py does)."""
import os
import sys
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if "sd_accel" not in sys.modules:
    pkg = types.ModuleType("sd_accel")
    pkg.__path__ = [REPO]
    sys.modules["sd_accel"] = pkg

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def graph_us(fn, calls=10):
    """Median µs per call replaying `calls` calls captured in one CUDA graph: GPU time without the
    host's launch overhead, which is what a CUDA-graphed UNet step pays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm up (compile, allocator) off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return do_bench(graph.replay, return_mode="median") * 1e3 / calls


def eager_us(fn):
    return do_bench(fn, return_mode="median") * 1e3


def save_lines(out_dir, name, lines):
    """The printed table's lines to `out_dir`/`name` (the device run's $OUT), when a folder was given."""
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, name), "w") as f:
            f.write("\n".join(lines) + "\n")
