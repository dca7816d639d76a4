"""Memory: running a model within a VRAM budget.

  vram_plan      which UNet blocks stay resident and which stream, for a budget (pure arithmetic)
  offload        block streaming through a fixed GPU ring (copies a CUDA graph can hold)
  residency      the token by which a module says its weights live where a fingerprint cannot see them
  host_mirror, pinned_memory  pinned host copies of weights; slabs of torch's pinned allocator
  vae_plan       whole or tiled VAE decode for a budget
May import kernels/ and engine/reports; never patches/, graphs/ or a host.
"""
