"""torch.compile in the user's graph: ComfyUI's TorchCompileModel (current ComfyUI: an APPLY_MODEL wrapper keyed
"torch.compile" that puts the compiled diffusion model in place for each call; older ComfyUI and other packs: an
object patch holding the compiled module) and any module compiled in place.

torch.compile traces whatever runs inside the compiled module. SD Accel's stand-ins there would be traced with
their Python (kernel dispatch, per-thread state, Triton launches), which dynamo cannot always trace, and CUDA
graphs captured around compiled code would hold its guards and recompilations. So a model the user compiles is
left to torch.compile: SD Accel plans nothing on it, and where it was applied first (Apply SD Accel, then
TorchCompileModel) its step runs the host's own modules, without graphs. One line in the report says so.
"""
COMPILE_KEY = "torch.compile"     # comfy_api.torch_helpers.torch_compile's wrapper key
_SEEN = "_sd_accel_compiled_patches"   # on a patcher: (its object_patches dict, their count, the reason or None)
WHY = ("torch.compile in the graph (%s): SD Accel leaves the UNet to it (remove the compile node to use SD Accel's "
       "kernels and graphs instead)")


def is_compiled_module(obj):
    """A module wrapped by torch.compile (dynamo's OptimizedModule), told by its class: importing torch._dynamo to
    test isinstance would cost every plan a second of import."""
    cls = type(obj)
    return cls.__name__ == "OptimizedModule" and (cls.__module__ or "").startswith("torch._dynamo")


def _compiled_patch(object_patches):
    """The path of the first object patch that is a compiled module, or None."""
    return next((path for path, value in object_patches.items() if is_compiled_module(value)), None)


def _keyed(wrappers):
    return any(COMPILE_KEY in (keyed or {}) for keyed in (wrappers or {}).values())


def reason(patcher):
    """The one-line reason SD Accel leaves `patcher` (a ModelPatcher) to torch.compile, or None."""
    if _keyed(getattr(patcher, "wrappers", None)):
        return WHY % "TorchCompileModel"
    path = _compiled_patch(getattr(patcher, "object_patches", None) or {})
    if path is not None:
        return WHY % ("a compiled object patch at %s" % path)
    base = getattr(patcher, "model", None)
    if is_compiled_module(getattr(base, "diffusion_model", None)):
        return WHY % "the diffusion model compiled in place"
    return None


def in_call(transformer_options, base_model):
    """The reason for a call that runs compiled code, the compile added after SD Accel was (its wrapper in this
    run's, the diffusion model compiled, or a compiled object patch on the patcher sampling it), or None."""
    if _keyed((transformer_options or {}).get("wrappers")):
        return WHY % "TorchCompileModel after SD Accel"
    if is_compiled_module(getattr(base_model, "diffusion_model", None)):
        return WHY % "the diffusion model compiled after SD Accel"
    patcher = getattr(base_model, "current_patcher", None)   # current ComfyUI, while it samples
    patches = getattr(patcher, "object_patches", None)
    if not patches:
        return None
    seen = patcher.__dict__.get(_SEEN)
    if seen is None or seen[0] is not patches or seen[1] != len(patches):
        # read once per patch set: a run's calls find the same dict
        found = _compiled_patch(patches)
        seen = patcher.__dict__[_SEEN] = (patches, len(patches),
                                          WHY % ("a compiled object patch at %s" % found) if found else None)
    return seen[2]
