"""ComfyUI nodes for ControlNet condition maps (canny, depth, pose) with the persistent disk cache.

Thin layer over `engine/preprocess` and `engine/condition_cache`. ComfyUI modules (`folder_paths`,
`comfy`) are imported lazily inside functions, so this module imports without ComfyUI.
"""
from __future__ import annotations

import logging
import os

from ..engine.preprocess import condition_cache as cc
from ..engine import preprocess as pp
from ..engine.preprocess.canny import BLUR_SIZES
from ..engine.preprocess.depth import DEFAULT_DEPTH_MODEL, list_depth_models
from ..engine.preprocess.pose import DETECTOR_FILE, POSE_FILE, list_onnx_files, pose_search_dirs

log = logging.getLogger(__name__)

CATEGORY = "SD Accel/controlnet"
USE_CACHE_TIP = ("Reuse condition maps saved on disk by earlier runs (keyed by the exact pixels, every "
                 "setting and the model files). Turn off to always recompute; nothing is written then.")
IMAGE_TIP = "The source image or batch of video frames; each frame is cached on its own."


# ------------------------------------------------------------------------------- host helpers
def _folder_paths():
    try:
        import folder_paths
        return folder_paths
    except Exception:  # noqa: BLE001 - not running inside ComfyUI
        return None


def model_dirs(kind: str) -> list[str]:
    """ComfyUI's folders for a model kind ("depth", "pose"), registering `models/<kind>` if absent."""
    fp = _folder_paths()
    if fp is None:
        return []
    default = os.path.join(fp.models_dir, kind)
    try:
        paths = fp.get_folder_paths(kind)
    except KeyError:
        paths = []
    if default not in paths:
        fp.add_model_folder_path(kind, default, is_default=not paths)
    return fp.get_folder_paths(kind)


def aux_ckpts_roots() -> list[str]:
    """comfyui_controlnet_aux's `ckpts` folders under ComfyUI's custom_nodes folders."""
    fp = _folder_paths()
    if fp is None:
        return []
    try:
        roots = fp.get_folder_paths("custom_nodes")
    except KeyError:
        return []
    return [os.path.join(r, "comfyui_controlnet_aux", "ckpts") for r in roots]


def cache_directory() -> str:
    """$SDACCEL_CONDITION_CACHE_DIR, else <ComfyUI user dir>/sd_accel/condition_cache (temp dir outside ComfyUI)."""
    fp = _folder_paths()
    base = None
    if fp is not None:
        try:
            base = fp.get_user_directory()
        except Exception:  # noqa: BLE001
            base = None
    return cc.default_cache_dir(base)


def get_cache() -> cc.ConditionCache:
    return cc.shared_cache(cache_directory())


def torch_device():
    try:
        import comfy.model_management as mm
        return mm.get_torch_device()
    except Exception:  # noqa: BLE001
        return "cpu"


def progress_callback(total: int):
    """Per-frame progress for the ComfyUI frontend, and a check for the user's cancel; None outside ComfyUI."""
    try:
        import comfy.model_management as mm
        import comfy.utils
    except Exception:  # noqa: BLE001
        return None
    bar = comfy.utils.ProgressBar(total)

    def cb(i, n):
        mm.throw_exception_if_processing_interrupted()
        bar.update(1)
    return cb


def run_node(pre, image, use_cache: bool):
    cache = get_cache() if use_cache else None
    out, report = pp.run(pre, image, cache=cache, progress=progress_callback(int(image.shape[0])))
    if report.misses or report.hits:
        log.info("[SD Accel] %s map: %d cached, %d computed, %.3f s", pre.name, report.hits,
                 report.misses, report.seconds)
    return {"ui": {"sdaccel_cache": [report.ui()]}, "result": (out,)}


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
        pre = pp.get_preprocessor("canny", low_threshold=low_threshold, high_threshold=high_threshold,
                                  blur=int(blur), l2_gradient=l2_gradient)
        return run_node(pre, image, use_cache)


class SDAccelDepthMap(_ConditionMapNode):
    DESCRIPTION = ("Depth map for ControlNet (near = bright), cached on disk. Runs a transformers depth model "
                   "(Depth Anything V2, DPT/MiDaS, ...) from a local folder in models/depth/<name> holding "
                   "config.json, model.safetensors and preprocessor_config.json, e.g. a copy of "
                   "depth-anything/Depth-Anything-V2-Small-hf. Nothing is downloaded.")
    OUTPUT_TOOLTIPS = ("The depth map as an IMAGE, ready for Apply ControlNet.",)

    @classmethod
    def INPUT_TYPES(cls):
        names = list_depth_models(model_dirs("depth"))
        choices = [DEFAULT_DEPTH_MODEL] + [n for n in names if n != DEFAULT_DEPTH_MODEL]
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
        pre = pp.get_preprocessor("depth", model=model_path.strip() or model, search_dirs=model_dirs("depth"),
                                  resolution=resolution, device=torch_device())
        return run_node(pre, image, use_cache)


class SDAccelPoseMap(_ConditionMapNode):
    DESCRIPTION = ("Whole-body OpenPose image for ControlNet (body, hands, face on black), cached on disk. "
                   "Runs the DWPose ONNX models through onnxruntime: yolox_l.onnx and dw-ll_ucoco_384.onnx "
                   "from models/pose/ or comfyui_controlnet_aux's ckpts folder (AUX_ANNOTATOR_CKPTS_PATH "
                   "is honoured). Nothing is downloaded.")
    OUTPUT_TOOLTIPS = ("The pose skeleton image, ready for Apply ControlNet (OpenPose models).",)

    @classmethod
    def _dirs(cls):
        return pose_search_dirs(model_dirs("pose"), aux_ckpts_roots())

    @classmethod
    def INPUT_TYPES(cls):
        found = list_onnx_files(cls._dirs())
        dets = [DETECTOR_FILE] + [f for f in found if f != DETECTOR_FILE and "yolo" in f.lower()]
        poses = [POSE_FILE] + [f for f in found if f != POSE_FILE and "yolo" not in f.lower()]
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
        pre = pp.get_preprocessor("pose", detector=detector, pose_model=pose_model, search_dirs=self._dirs(),
                                  include_body=include_body, include_hands=include_hands,
                                  include_face=include_face)
        return run_node(pre, image, use_cache)


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
        cache = get_cache()
        lines = []
        if max_size_mb:
            evicted = cache.set_max_bytes(int(max_size_mb) * 1024 ** 2)
            lines.append(f"cap set to {max_size_mb} MiB" + (f", evicted {evicted} entries" if evicted else ""))
        if clear:
            n, b = cache.clear()
            lines.append(f"cleared {n} entries ({b / 1024 ** 2:.1f} MiB)")
        text = cache.stats().as_text() + ("\n" + "\n".join(lines) if lines else "")
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
