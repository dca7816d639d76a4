"""The host-agnostic engine. Imports nothing from ComfyUI, A1111 or Forge: each host passes in what it needs
(weight casting, module paths) and applies the returned patches its own reversible way.

  patches/     which modules of a UNet or ControlNet to replace, and the stand-ins that replace them
  graphs/      CUDA-graph replay of a step: keys, the capturability probe, capture, the eager path
  memory/      VRAM budgets: residency plans, block streaming, pinned host copies, VAE decode plans
  preprocess/  ControlNet condition maps (canny, depth, pose) and their .pt cache
  reports/     what ran and what fell back: kernel calls, the per-run report, VRAM stages
  deferred_preview  a sampler's step callback delivered a few steps late, on a pinned host copy of the latent
Layers: kernels/ <- reports <- patches <- memory, graphs <- hosts. Nothing here imports hosts/ or nodes/.
"""
