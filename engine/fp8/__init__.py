"""FP8 compute (precision "fp8", LOSSY, opt-in) and fp8-stored weights: device support, the GEMM recipe probed
per device, the per-weight FP8 / upcast copies, the Linear stand-in and the plan of which modules get it."""
