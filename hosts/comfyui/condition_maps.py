"""ComfyUI host, condition maps: where the map nodes find models and their cache inside ComfyUI, and their
progress bar. ComfyUI modules (`folder_paths`, `comfy`) are imported inside the functions, so this module
imports without ComfyUI (the nodes' tests run it so)."""
from __future__ import annotations

import inspect
import logging
import os

from ...engine import preprocess as pp
from ...engine.preprocess import condition_cache as cc
from ...engine.preprocess.canny import BLUR_SIZES  # noqa: F401  (the nodes' choices)
from ...engine.preprocess.depth import DEFAULT_DEPTH_MODEL, list_depth_models
from ...engine.preprocess.pose import DETECTOR_FILE, POSE_FILE, list_onnx_files, pose_search_dirs

log = logging.getLogger("sd_accel")


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
        if "is_default" in inspect.signature(fp.add_model_folder_path).parameters:
            fp.add_model_folder_path(kind, default, is_default=not paths)
        else:   # ComfyUI 2024: appends; it reads the first folder as the default, ours when there was none
            fp.add_model_folder_path(kind, default)
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


# -- what the map nodes call ---------------------------------------------------------------------------------
def depth_model_choices():
    """The depth model folders ComfyUI's folders hold, the default first."""
    names = list_depth_models(model_dirs("depth"))
    return [DEFAULT_DEPTH_MODEL] + [n for n in names if n != DEFAULT_DEPTH_MODEL]


def pose_dirs():
    return pose_search_dirs(model_dirs("pose"), aux_ckpts_roots())


def pose_file_choices():
    """(detector files, pose model files) found, the defaults first."""
    found = list_onnx_files(pose_dirs())
    dets = [DETECTOR_FILE] + [f for f in found if f != DETECTOR_FILE and "yolo" in f.lower()]
    poses = [POSE_FILE] + [f for f in found if f != POSE_FILE and "yolo" not in f.lower()]
    return dets, poses


def canny_map(image, low_threshold, high_threshold, blur, l2_gradient, use_cache):
    pre = pp.get_preprocessor("canny", low_threshold=low_threshold, high_threshold=high_threshold,
                              blur=int(blur), l2_gradient=l2_gradient)
    return run_node(pre, image, use_cache)


def depth_map(image, model, resolution, use_cache, model_path=""):
    pre = pp.get_preprocessor("depth", model=model_path.strip() or model, search_dirs=model_dirs("depth"),
                              resolution=resolution, device=torch_device())
    return run_node(pre, image, use_cache)


def pose_map(image, detector, pose_model, include_body, include_hands, include_face, use_cache):
    pre = pp.get_preprocessor("pose", detector=detector, pose_model=pose_model, search_dirs=pose_dirs(),
                              include_body=include_body, include_hands=include_hands, include_face=include_face)
    return run_node(pre, image, use_cache)


def cache_report(clear=False, max_size_mb=0):
    """The cache's stats as text, after an optional clear and a new size cap."""
    cache = get_cache()
    lines = []
    if max_size_mb:
        evicted = cache.set_max_bytes(int(max_size_mb) * 1024 ** 2)
        lines.append(f"cap set to {max_size_mb} MiB" + (f", evicted {evicted} entries" if evicted else ""))
    if clear:
        n, b = cache.clear()
        lines.append(f"cleared {n} entries ({b / 1024 ** 2:.1f} MiB)")
    return cache.stats().as_text() + ("\n" + "\n".join(lines) if lines else "")
