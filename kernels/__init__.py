"""Fused GPU kernels, one op per file.

Each file holds the Triton kernel(s), a launcher, and a plain-torch reference. The public function of
each op checks eligibility (device, dtype, layout, sizes) and falls back to the reference instead of
raising. Importing this package never imports Triton: each op imports it lazily through `_triton`.
"""
