"""Test stand-in for Kosinkadink/ComfyUI-AnimateDiff-Evolved: temporal modules injected into an SD1.5 UNet
and sliding context windows over the frames of a latent batch, hooked into ComfyUI the way AnimateDiff
hooks it: PatcherInjection and keyed wrappers on current ComfyUI (hooks_current.py), a ModelPatcher subclass
and module-global swaps on the 2024 ComfyUI (hooks_2024.py). Random temporal weights instead of a motion
model checkpoint. docs/other_packs.md says what is reproduced and from which files. Used only by the tests.
"""
import comfy.model_patcher

from . import motion as mm

if hasattr(comfy.model_patcher.ModelPatcher, "set_injections"):
    from . import hooks_current as hooks
else:
    from . import hooks_2024 as hooks
    hooks.install()


class ADLikeApplyMotion:
    DESCRIPTION = "Test stand-in: AnimateDiff's motion modules and context options on a model."
    CATEGORY = "sdaccel_tests"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL",),
            "seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31}),
            "motion_version": (["v2", "v1"], {"default": "v2"}),   # v1: GroupNorm across frames
            "context_length": ("INT", {"default": 0, "min": 0, "max": 32}),   # 0: no sliding windows
            "context_overlap": ("INT", {"default": 4, "min": 0, "max": 32}),
            "context_schedule": (["standard_uniform", "standard_static"], {"default": "standard_uniform"}),
            "fuse_method": (["pyramid", "flat"], {"default": "pyramid"}),
        }}

    def apply(self, model, seed, motion_version, context_length, context_overlap, context_schedule, fuse_method):
        motion = mm.MotionModelLike(model.model.diffusion_model, seed)
        motion.to(dtype=model.model.get_dtype())
        params = {"motion_version": motion_version, "context_length": context_length,
                  "context_overlap": context_overlap, "context_schedule": context_schedule, "fuse_method": fuse_method}
        return (hooks.apply(model, motion, params),)


NODE_CLASS_MAPPINGS = {"ADLikeApplyMotion": ADLikeApplyMotion}
NODE_DISPLAY_NAME_MAPPINGS = {"ADLikeApplyMotion": "AnimateDiff-like Apply Motion (test stand-in)"}
