"""Memory: running a model within a VRAM budget.

  vram_plan      the planner: which UNet blocks stay resident and which stream for a budget, and where one
                 sampling run's weights go (the loader's budget, promoted blocks); pure arithmetic on sizes
  stream_units   the unit of placement: a UNet cut into the modules a step runs one after another
  ring           fixed places of the streamed blocks in one GPU ring
  offload        block streaming through that ring (copies a CUDA graph can hold)
  block_buffers  a block's tensors in one pinned host buffer (one copy per block), reused across runs
  promoted_blocks  streamed blocks given GPU copies for one run where the budget has room
  residency      the token by which a module says its weights live where a fingerprint cannot see them
  host_mirror, pinned_memory  pinned host copies of weights; slabs of torch's pinned allocator
  vae_plan       whole or tiled VAE decode for a budget
May import kernels/ and engine/reports; never patches/, graphs/ or a host.
"""
