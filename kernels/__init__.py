"""Fused GPU kernels, one op per file.

Each op file (<op>.py) holds the Triton kernel(s), a launcher, the op, and a plain-torch reference, in
that order. The op is declared once (`_dispatch.fused_op`): its eligibility (device, dtype, layout, sizes), its launch
and its fallback; the one dispatch chain in `_dispatch` runs them and records which path each call took
(`op.last_call`), so an op falls back to its reference instead of raising. Importing this package never
imports Triton: each op imports it lazily through `_triton`.

The rest, one job a file:
  _triton.py             the guarded Triton import; can a kernel take this tensor (the eligibility helpers)
  _device.py             what the kernels read from the CUDA device (capability, SM count, allocator), cached
  _tiling.py             tile and grid arithmetic shared by the launchers
  _launch.py             a launch through the compiled kernel with raw addresses (CUDA-graph captures)
  _compile_ahead.py      compiling a step's kernels in parallel before their first launch (Triton internals)
  _dispatch.py           the dispatch chain, the op registry and the recorder of each call's outcome
  _group_norm_tiling.py  group_norm_silu's path choice and split-path tiling, with its tuned constants
  errors.py              `first_line`: an exception as one line of a log message (used by every layer)
"""
