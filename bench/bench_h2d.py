#!/usr/bin/env python3
"""Host-to-device copy bandwidth on the GPU machine: the ceiling of lowvram block streaming (issue 4).

Copies 1.5 GiB (about what SD1.5 @1 GiB streams per step) from pinned (torch's allocator, and SD Accel's
views of packed pinned slabs) and from pageable host memory, as one
tensor and as per-tensor copies with SD1.5 UNet-like sizes (a few large weights, many small biases and
norms), on a side stream, and prints GB/s. No ComfyUI; nothing is recorded in results.jsonl (it compares
no stock path), the numbers go to the run's log.

  python3 bench/bench_h2d.py [--gib 1.5]

Also: the same copies as the lowvram ring makes them (one pinned buffer per SD1.5-sized block, into two
alternating places, on a side stream) captured in a CUDA graph and replayed, alone and with matmuls on
the compute stream alongside.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_timing  # noqa: E402,F401  (registers the repo as the package sd_accel)
from sd_accel.engine.memory import pinned_memory  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--gib", type=float, default=1.5)
OPT = ap.parse_args()
dev = torch.device("cuda")
total = int(OPT.gib * 2 ** 30) // 2      # fp16 elements


def unet_like_sizes(n_elems):
    """Sizes in fp16 elements: per 'layer' one 1280x1280x3x3-ish conv, two linears, and 6 small vectors."""
    layer = [1280 * 1280 * 9 // 4, 640 * 640, 640 * 2560, 640, 640, 640, 1280, 1280, 2560]
    out, acc = [], 0
    while acc < n_elems:
        for s in layer:
            out.append(s)
            acc += s
    return out


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def host_buffers(sizes, kind):
    """fp16 host tensors of `sizes` elements: torch's pinned allocator, one allocation each ("pinned"), SD
    Accel's views of packed pinned slabs (engine/memory/pinned_memory.py, "pinned slabs"), or pageable."""
    if kind == "pinned slabs":
        return [b.view(torch.float16) for b in pinned_memory.host_buffers([2 * n for n in sizes], True)]
    return [torch.empty(n, dtype=torch.float16, pin_memory=kind == "pinned") for n in sizes]


stream = torch.cuda.Stream()
rows = []
for kind in ("pinned", "pinned slabs", "pageable"):
    big = host_buffers([total], kind)[0]
    dst = torch.empty(total, dtype=torch.float16, device=dev)
    sizes = unet_like_sizes(total)
    parts = host_buffers(sizes, kind)
    nbytes = sum(p.numel() for p in parts) * 2

    def one():
        with torch.cuda.stream(stream):
            dst.copy_(big, non_blocking=True)

    def many():
        with torch.cuda.stream(stream):
            [torch.empty_like(p, device=dev).copy_(p, non_blocking=True) for p in parts]

    t1, tm = timed(one), timed(many)
    rows.append((kind, total * 2 / t1 / 1e9, len(parts), nbytes / tm / 1e9))
    del big, dst, parts

# The lowvram ring's case: copies of whole blocks (SD1.5-like sizes, one pinned buffer each) on a side stream,
# replayed from a CUDA graph, alone and while the compute stream runs matmuls (HBM-heavy work, as a step does)
blocks_mib = [4, 9, 9, 2, 30, 33, 7, 113, 126, 28, 59, 59, 185, 94, 94, 122, 160, 160, 173, 50, 42, 45, 13, 11, 11]
hosts = [torch.empty(m * 2 ** 20, dtype=torch.uint8, pin_memory=True) for m in blocks_mib]
ring = torch.empty(max(blocks_mib) * 2 ** 20 * 2, dtype=torch.uint8, device=dev)
a = torch.randn(8192, 8192, device=dev, dtype=torch.float16)
a @ a                  # cuBLAS's handle is created outside the capture
torch.cuda.synchronize()
graph_rows = []
for concurrent in (False, True):
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        cap = torch.cuda.current_stream()
        side.wait_stream(cap)
        with torch.cuda.stream(side):
            for i, h in enumerate(hosts):
                off = (i % 2) * max(blocks_mib) * 2 ** 20
                ring[off:off + h.numel()].copy_(h, non_blocking=True)
        if concurrent:
            for _ in range(40):
                a @ a
        cap.wait_stream(side)
    t = timed(g.replay)
    # beside the matmuls the replay's time is the longer of the two streams: no bandwidth is computed there
    graph_rows.append(("graph, blocks on a side stream" + (", matmuls alongside" if concurrent else ""),
                       "-" if concurrent else "%.1f" % (sum(blocks_mib) * 2 ** 20 / t / 1e9), t * 1e3))
mm_t = timed(lambda: [a @ a for _ in range(40)])


def copies_timed_by_events(with_matmuls):
    """GB/s of the block copies on their own stream, timed by events on that stream (eager)."""
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    side.wait_stream(torch.cuda.current_stream())
    if with_matmuls:
        for _ in range(40):
            a @ a
    with torch.cuda.stream(side):
        start.record(side)
        for i, h in enumerate(hosts):
            off = (i % 2) * max(blocks_mib) * 2 ** 20
            ring[off:off + h.numel()].copy_(h, non_blocking=True)
        end.record(side)
    torch.cuda.synchronize()
    return sum(blocks_mib) * 2 ** 20 / (start.elapsed_time(end) / 1e3) / 1e9


copies_timed_by_events(False)
event_rows = [(label, max(copies_timed_by_events(m) for _ in range(3))) for label, m in
              (("copies alone", False), ("copies while 40 matmuls run", True))]

print("\nH2D copy bandwidth, %s, %.2f GiB" % (torch.cuda.get_device_name(), OPT.gib))
print("| host memory | one tensor GB/s | tensors | per-tensor copies GB/s |")
print("|---|---:|---:|---:|")
for r in rows:
    print("| %s | %.1f | %d | %.1f |" % r)
print("\n%d SD1.5-like blocks, %.2f GiB, pinned; 40 fp16 8192^2 matmuls alone: %.1f ms" % (
    len(blocks_mib), sum(blocks_mib) / 1024, mm_t * 1e3))
print("| case | GB/s | ms |")
print("|---|---:|---:|")
for r in graph_rows:
    print("| %s | %s | %.1f |" % r)
print("\nThe same copies timed by events on their own stream (eager), best of 3:")
print("| case | GB/s |")
print("|---|---:|")
for r in event_rows:
    print("| %s | %.1f |" % r)
