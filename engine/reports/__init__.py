"""Reports: what ran and what fell back, and why.

  kernel_report  per-op counts of fused and reference calls (replays counted from their captures)
  run_report     the Accelerated KSampler's per-run report and its one line
  vram_report    peak allocated/reserved memory per stage (text encode, sampling, decode)
May import kernels/ only.
"""
