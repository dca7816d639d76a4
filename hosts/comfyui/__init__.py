"""ComfyUI host: everything that knows ComfyUI's ModelPatcher, samplers and model management.

  accelerate      SD Accel on a cloned ModelPatcher: object patches, the step wrapper, graph routes
  run             one Accelerated KSampler run (AcceleratedRun): prepare, sample with a stock fallback, report
  previews        its live previews a few steps late: ComfyUI's own callback, deferred on the sampling thread
  object_patches  the engine's module swaps as ComfyUI object patches, folded per top-level block
  plan_reuse      one plan per model and inputs: alike clones get the same modules, and keep each other's graphs
  precision       which precision paths a clone gets: FP8 compute (LOSSY), upcast copies of fp8-stored weights
  step_cache      DeepCache (LOSSY): the run's schedule and marks; step_cache_unet runs the shallow blocks
  controlnet      copies of the ControlNets in the conds, patched; controlnet_cond_only its cond-only mode
  condition_maps  where the condition-map nodes find their models and cache in ComfyUI, their progress bar
  control_graph   a step's ControlNet chain inside the UNet's CUDA graph
  memory          the VRAM Pool's run wiring: its wrappers, one placement per attempt, the out-of-memory retry
  memory_scopes   what the pool reads from and sets on ComfyUI's model_management around a run
  lowvram         streaming what ComfyUI's loader left off the GPU, and the promoted blocks
  clip_stage      the pool's clip output: the text encode under its budget
  vae, vae_accel  the VAE nodes' planned decode and encode; the accelerated VAE copy (fused modules, graphs)
Imported by nodes/ only. Works on ComfyUI 2024-03 and current ComfyUI: host APIs are feature-detected.
"""
