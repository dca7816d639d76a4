"""The harness every per-op kernel benchmark runs on (GPU only), and the timing helpers other benches share.

A `bench/bench_<op>.py` is a setup function over this harness: `setup(dtype)` yields one `Case` per shape
(its inputs built, the fused op's error against the fp32 reference measured), and `run(op, setup, ...)`
parses the command line, times torch's way and the fused op eagerly and replayed from a CUDA graph (GPU
time alone, what a graphed UNet step pays), and prints one table: the speed-ups, the fused op's achieved
bandwidth in the graph, and its max abs error. Every case must run the Triton kernel, not its fallback.

Importing this also registers the repo as the package `sd_accel`, whatever its folder is called (as
tests/conftest.py does).
"""
import argparse
import os
import sys
import types
from typing import Callable, NamedTuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if "sd_accel" not in sys.modules:
    pkg = types.ModuleType("sd_accel")
    pkg.__path__ = [REPO]
    sys.modules["sd_accel"] = pkg

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


# (batch, tokens, D): the transformer residual stream at each level, CFG batch 2 at 512² (SD1.5) and 1024²
# (SDXL), and batch 8: the shapes the LayerNorm kernels see
RESIDUAL_STREAM_SHAPES = [
    ("sd15", (2, 4096, 320)), ("sd15", (2, 1024, 640)), ("sd15", (2, 256, 1280)),
    ("sd15", (2, 64, 1280)), ("sdxl", (2, 4096, 640)), ("sdxl", (2, 1024, 1280)),
    ("b8", (8, 4096, 320)),
]

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


class Case(NamedTuple):
    """One row of a kernel benchmark."""
    labels: tuple              # the row's first columns (model, shape, layout, ...), as `run`'s label_columns
    stock: Callable            # torch's way, as the host runs it
    fused: Callable            # the fused op on the same inputs
    moved_bytes: int           # what the fused op reads and writes once, for its bandwidth
    max_err: float             # the fused op's max abs error against the fp32 reference
    extra: tuple = ()          # the bench's own last columns, as `run`'s extra_columns


_TIMES = [("dtype", 9, ""), ("torch us", 9, ".1f"), ("ours us", 9, ".1f"), ("speedup", 7, ""),
          ("torch graph", 11, ".1f"), ("ours graph", 10, ".1f"), ("speedup", 7, ""), ("GB/s", 6, ".0f"),
          ("max err", 9, ".2e")]


def _header(label_columns, extra_columns):
    cols = [f"{name:{width}}" for name, width in label_columns]
    cols += [f"{name:{width}}" if name == "dtype" else f"{name:>{width}}" for name, width, _ in _TIMES]
    return " ".join(cols + [f"{name:>{width}}" for name, width in extra_columns])


def _row(case, dtype, label_columns, extra_columns):
    e_t, e_o = eager_us(case.stock), eager_us(case.fused)
    g_t, g_o = graph_us(case.stock), graph_us(case.fused)
    gbs = case.moved_bytes / (g_o * 1e-6) / 1e9
    cols = [f"{str(v):{width}}" for v, (_, width) in zip(case.labels, label_columns)]
    cols += [f"{str(dtype)[6:]:9}", f"{e_t:9.1f}", f"{e_o:9.1f}", f"{e_t / e_o:6.2f}x",
             f"{g_t:11.1f}", f"{g_o:10.1f}", f"{g_t / g_o:6.2f}x", f"{gbs:6.0f}", f"{case.max_err:9.2e}"]
    return " ".join(cols + [f"{str(v):>{width}}" for v, (_, width) in zip(case.extra, extra_columns)])


def run(op, setup, label_columns, extra_columns=(), description=None):
    """Parse `--dtype` and `--out`, then time and print every Case of `setup(dtype)`.

    op: the fused op (its `last_call` must say the kernel ran); label_columns / extra_columns: (name, width)
    of the columns before / after the timings."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--dtype", default="fp16", choices=DTYPES)
    ap.add_argument("--out", default=None, help="also write the table to this folder")
    opt = ap.parse_args()
    dtype = DTYPES[opt.dtype]
    torch.manual_seed(0)
    lines = [_header(label_columns, extra_columns)]
    print(lines[0], flush=True)
    for case in setup(dtype):
        last = op.last_call
        assert last is not None and last.path == "triton", last
        lines.append(_row(case, dtype, label_columns, extra_columns))
        print(lines[-1], flush=True)
    save_lines(opt.out, f"{op.name}.txt", lines)
