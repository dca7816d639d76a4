"""FP8 compute (precision "fp8", LOSSY, opt-in) and fp8-stored weights: device support, the GEMM recipe probed
per device, the per-weight FP8 / upcast copies, the forward patches set on the host's own Linear/Conv2d layers
(engine/patches/forward_patches.py) and the plan of which layers get one."""
