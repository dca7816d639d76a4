"""Patches: which modules of a UNet (or ControlNet) SD Accel replaces, and the stand-ins that replace them.

The plan is data, `{attribute path: replacement module}` (patching.plan_patches, layout_modules,
patch_folding), or `{"<layer path>.forward": forward patch}` for layers whose own weights the host patches
(forward_patches.py); each host applies it its own reversible way. Stand-ins keep their host class (isinstance holds)
and its parameter names (LoRA and weight patches find them), read weights through the host's casting, and run
their host class's own forward inside `stock_path.stock_modules()`.
May import kernels/, engine/reports and engine/memory/residency (the token of weights a fingerprint cannot see);
never graphs/, the rest of memory/ or a host.
"""
