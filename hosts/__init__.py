"""Hosts: how each UI applies the engine's patches its own reversible way.

  comfyui/   ComfyUI: object patches and wrappers on cloned ModelPatchers, the per-run AcceleratedRun, the
             ControlNets, the VRAM Pool, the VAE and condition-map nodes' glue
  a1111.py   AUTOMATIC1111 WebUI: in-place module swaps with a way back, graphs through its sd_unet hook
  a1111_fp8.py, a1111_lora.py  A1111's precision fp8 (FP8 forwards set on its Linears), and what its Lora
             extension does in the forwards SD Accel's replacements bypass
  forge.py, forge_plan.py  Stable Diffusion WebUI Forge: object patches on its UnetPatcher, graphs through
             its model_function_wrapper
  webui.py   what A1111 and Forge share: the settings, their section, the status counts
May import engine/ and kernels/; nodes/ and scripts/ import hosts, never the other way round.
"""
