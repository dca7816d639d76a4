"""ComfyUI nodes for ControlNet condition maps (canny, depth, pose) with the persistent disk cache.

Thin nodes over hosts/comfyui/condition_maps.py (engine/preprocess's preprocessors and the ComfyUI glue: model
folders, the cache's place, progress); this module imports without ComfyUI.
"""
from __future__ import annotations

from ..hosts.comfyui import condition_maps as host
from ..hosts.comfyui.condition_maps import BLUR_SIZES, DEFAULT_DEPTH_MODEL, DETECTOR_FILE, POSE_FILE

CATEGORY = "SD Accel/controlnet"
USE_CACHE_TIP = ("Reuse condition maps saved on disk by earlier runs (keyed by the exact pixels, every "
                 "setting and the model files). Turn off to always recompute; nothing is written then.")
IMAGE_TIP = "The source image or batch of video frames; each frame is cached on its own."


def _tip(text, **opts):
    return dict(opts, tooltip=text)


# ---------------------------------------------------------------------------------------- nodes
class _ConditionMapNode:
    """What the three map nodes share: category, entry point, one IMAGE output."""
    CATEGORY = CATEGORY
    FUNCTION = "execute"
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("condition",)


class SDAccelCannyMap(_ConditionMapNode):
    DESCRIPTION = ("Canny edge map for ControlNet (white edges on black), cached on disk. Uses OpenCV's "
                   "cv2.Canny when OpenCV is installed, otherwise an exact torch port of it (no kornia "
                   "hysteresis, so it is fast on CPU too). Thresholds are on the 0-255 scale: 100/200 is "
                   "the A1111 / controlnet_aux default.")
    OUTPUT_TOOLTIPS = ("The edge map as an IMAGE, ready for Apply ControlNet.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "image": ("IMAGE", _tip(IMAGE_TIP)),
            "low_threshold": ("INT", _tip("Edges weaker than this are dropped (0-255 scale). Lower keeps "
                                          "more faint edges.", default=100, min=0, max=1000, step=1)),
            "high_threshold": ("INT", _tip("Edges stronger than this always stay; weaker ones stay only "
                                           "if connected to a strong edge.", default=200, min=0, max=1000,
                                           step=1)),
            "blur": ([str(b) for b in BLUR_SIZES], _tip("Gaussian blur kernel size before edge detection "
                                                         "(0 = off). Blur removes texture noise.",
                                                         default="0")),
            "l2_gradient": ("BOOLEAN", _tip("Use the exact gradient magnitude (L2) instead of |dx|+|dy|; "
                                            "slightly fewer, cleaner edges.", default=False)),
            "use_cache": ("BOOLEAN", _tip(USE_CACHE_TIP, default=True)),
        }}

    def execute(self, image, low_threshold=100, high_threshold=200, blur="0", l2_gradient=False,
                use_cache=True):
        return host.canny_map(image, low_threshold, high_threshold, blur, l2_gradient, use_cache)


class SDAccelDepthMap(_ConditionMapNode):
    DESCRIPTION = ("Depth map for ControlNet (near = bright), cached on disk. Runs a transformers depth model "
                   "(Depth Anything V2, DPT/MiDaS, ...) from a local folder in models/depth/<name> holding "
                   "config.json, model.safetensors and preprocessor_config.json, e.g. a copy of "
                   "depth-anything/Depth-Anything-V2-Small-hf. Nothing is downloaded.")
    OUTPUT_TOOLTIPS = ("The depth map as an IMAGE, ready for Apply ControlNet.",)

    @classmethod
    def INPUT_TYPES(cls):
        choices = host.depth_model_choices()
        return {"required": {
            "image": ("IMAGE", _tip(IMAGE_TIP)),
            "model": (choices, _tip("Model folder under models/depth (transformers format).",
                                    default=DEFAULT_DEPTH_MODEL)),
            "resolution": ("INT", _tip("Resolution the model runs at (0 = the model's own, 518 for "
                                       "Depth Anything). Higher gives finer detail and takes longer.",
                                       default=0, min=0, max=4096, step=14)),
            "use_cache": ("BOOLEAN", _tip(USE_CACHE_TIP, default=True)),
        }, "optional": {
            "model_path": ("STRING", _tip("Absolute path of a model folder; when set it is used instead of "
                                          "`model`.", default="")),
        }}

    def execute(self, image, model=DEFAULT_DEPTH_MODEL, resolution=0, use_cache=True, model_path=""):
        return host.depth_map(image, model, resolution, use_cache, model_path)


class SDAccelPoseMap(_ConditionMapNode):
    DESCRIPTION = ("Whole-body OpenPose image for ControlNet (body, hands, face on black), cached on disk. "
                   "Runs the DWPose ONNX models through onnxruntime: yolox_l.onnx and dw-ll_ucoco_384.onnx "
                   "from models/pose/ or comfyui_controlnet_aux's ckpts folder (AUX_ANNOTATOR_CKPTS_PATH "
                   "is honoured). Nothing is downloaded.")
    OUTPUT_TOOLTIPS = ("The pose skeleton image, ready for Apply ControlNet (OpenPose models).",)

    @classmethod
    def INPUT_TYPES(cls):
        dets, poses = host.pose_file_choices()
        return {"required": {
            "image": ("IMAGE", _tip(IMAGE_TIP)),
            "detector": (dets, _tip("Person detector ONNX file (YOLOX).", default=DETECTOR_FILE)),
            "pose_model": (poses, _tip("Whole-body keypoint ONNX file (DWPose / RTMPose SimCC).",
                                       default=POSE_FILE)),
            "include_body": ("BOOLEAN", _tip("Draw the 18-point body skeleton.", default=True)),
            "include_hands": ("BOOLEAN", _tip("Draw the hand keypoints and bones.", default=True)),
            "include_face": ("BOOLEAN", _tip("Draw the face landmarks.", default=True)),
            "use_cache": ("BOOLEAN", _tip(USE_CACHE_TIP, default=True)),
        }}

    def execute(self, image, detector=DETECTOR_FILE, pose_model=POSE_FILE, include_body=True,
                include_hands=True, include_face=True, use_cache=True):
        return host.pose_map(image, detector, pose_model, include_body, include_hands, include_face, use_cache)


class SDAccelConditionCache:
    DESCRIPTION = ("Shows the condition-map cache: its folder, size, number of entries and this session's "
                   "hits and misses; can clear it and change its size cap. The folder is "
                   "<ComfyUI>/user/sd_accel/condition_cache unless SDACCEL_CONDITION_CACHE_DIR is set.")
    CATEGORY = CATEGORY
    FUNCTION = "execute"
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("report",)
    OUTPUT_TOOLTIPS = ("The same report as text.",)
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "clear": ("BOOLEAN", _tip("Delete every cached condition map (only the cache's own .pt entries "
                                      "in its folder).", default=False)),
            "max_size_mb": ("INT", _tip("Size cap in MiB; the least recently used maps are evicted beyond "
                                        "it. 0 keeps the current cap (2048 MiB unless "
                                        "SDACCEL_CONDITION_CACHE_MAX_MB is set).", default=0, min=0,
                                        max=1 << 24, step=64)),
        }}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")  # always re-run: the numbers change between prompts

    def execute(self, clear=False, max_size_mb=0):
        text = host.cache_report(clear, max_size_mb)
        return {"ui": {"text": [text]}, "result": (text,)}


NODE_CLASS_MAPPINGS = {
    "SDAccelCannyMap": SDAccelCannyMap,
    "SDAccelDepthMap": SDAccelDepthMap,
    "SDAccelPoseMap": SDAccelPoseMap,
    "SDAccelConditionCache": SDAccelConditionCache,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "SDAccelCannyMap": "SD Accel Canny Map",
    "SDAccelDepthMap": "SD Accel Depth Map",
    "SDAccelPoseMap": "SD Accel Pose Map",
    "SDAccelConditionCache": "SD Accel Condition Cache",
}
