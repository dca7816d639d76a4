"""Depth maps with transformers depth models (Depth Anything V1/V2, DPT / MiDaS, ...) from a local folder.

The folder is a transformers checkpoint: `config.json`, `model.safetensors` (or `pytorch_model.bin`)
and `preprocessor_config.json`, e.g. a copy of `depth-anything/Depth-Anything-V2-Small-hf`. It is
loaded with `local_files_only=True`; nothing is ever downloaded.

Output convention (what ControlNet depth models were trained on): inverse depth, near = bright,
min-max normalised per image to [0, 1] and quantised to uint8. Relative models (Depth Anything,
DPT/MiDaS) already predict inverse depth; metric models (ZoeDepth, Depth Anything metric, GLPN,
DepthPro) predict distance and are inverted.
"""
from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .cache_keys import file_identity, library_majors
from . import MissingWeightsError

DEFAULT_DEPTH_MODEL = "Depth-Anything-V2-Small-hf"
REQUIRED_FILES = ("config.json", "model.safetensors", "preprocessor_config.json")
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                 "pytorch_model.bin.index.json")
_RELATIVE_TYPES = {"dpt", "depth_anything"}  # predict inverse depth (disparity)

_loaded: "OrderedDict[tuple, tuple]" = OrderedDict()
_load_lock = threading.Lock()
MAX_LOADED = 1


def is_model_dir(path: str) -> bool:
    return (os.path.isfile(os.path.join(path, "config.json"))
            and os.path.isfile(os.path.join(path, "preprocessor_config.json"))
            and any(os.path.isfile(os.path.join(path, f)) for f in _WEIGHT_FILES))


def list_depth_models(search_dirs: Sequence[str]) -> list[str]:
    """Names of model folders directly under the search folders."""
    names = set()
    for d in search_dirs:
        try:
            for e in os.scandir(d):
                if e.is_dir() and is_model_dir(e.path):
                    names.add(e.name)
        except OSError:
            continue
    return sorted(names)


def resolve_model_dir(model: str, search_dirs: Sequence[str]) -> str:
    """An absolute model folder, or a folder name looked up under `search_dirs`, in order."""
    model = os.path.expanduser(model.strip())
    if os.path.isabs(model):
        candidates = [model]
    else:
        candidates = [os.path.join(d, model) for d in search_dirs]
    for c in candidates:
        if is_model_dir(c):
            return os.path.abspath(c)
    raise MissingWeightsError(
        "depth", REQUIRED_FILES, candidates or [os.path.join("models", "depth", model)],
        hint="Use a transformers-format folder (for example a copy of "
             "depth-anything/Depth-Anything-V2-Small-hf); the original .pth checkpoints of "
             "comfyui_controlnet_aux are not in this format.")


def is_metric(config) -> bool:
    """True when the model predicts distance (far = large) rather than inverse depth."""
    if getattr(config, "model_type", "") not in _RELATIVE_TYPES:
        return True
    return getattr(config, "depth_estimation_type", "relative") == "metric"


def depth_to_u8(pred: torch.Tensor, size: tuple[int, int], metric: bool) -> np.ndarray:
    """One predicted depth map (h, w) -> uint8 (H, W): resized, near = bright, min-max per image."""
    d = pred.detach().float().cpu()
    d = F.interpolate(d[None, None], size=size, mode="bicubic", align_corners=False)[0, 0]
    d = torch.nan_to_num(d)
    lo, hi = d.min(), d.max()
    if float(hi - lo) <= 1e-12:
        return np.zeros(size, dtype=np.uint8)
    d = (d - lo) / (hi - lo)
    if metric:
        d = 1.0 - d
    return d.mul_(255).round_().clamp_(0, 255).to(torch.uint8).numpy()


def _load(path: str, identity: dict, device: str, dtype: torch.dtype):
    key = (path, json.dumps(identity, sort_keys=True), str(dtype))
    with _load_lock:
        hit = _loaded.get(key)
        if hit is not None:
            _loaded.move_to_end(key)
            return hit
        try:
            from transformers import AutoImageProcessor, AutoModelForDepthEstimation
        except ImportError as e:
            raise RuntimeError("SD Accel depth: the `transformers` package is not importable "
                               f"({e}); install it in ComfyUI's Python environment") from e
        model = AutoModelForDepthEstimation.from_pretrained(path, local_files_only=True)
        model = model.to(dtype=dtype).eval()
        try:
            processor = AutoImageProcessor.from_pretrained(path, local_files_only=True, use_fast=False)
        except (TypeError, ValueError):
            processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        while len(_loaded) >= MAX_LOADED:
            _loaded.popitem(last=False)
        _loaded[key] = (model, processor)
        return model, processor


def unload_all() -> None:
    with _load_lock:
        _loaded.clear()


class DepthPreprocessor:
    """Depth map with a transformers depth model from a local folder (see module docstring)."""

    name = "depth"
    channels = 1

    def __init__(self, model: str = DEFAULT_DEPTH_MODEL, search_dirs: Sequence[str] = (),
                 resolution: int = 0, device: str | torch.device | None = None,
                 dtype: str = "float32", batch_size: int = 4):
        self.path = resolve_model_dir(model, search_dirs)
        self.resolution = int(resolution)
        if self.resolution < 0:
            raise ValueError("resolution must be 0 (the model's own) or positive")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
        self.dtype_name = dtype
        self.batch_size = max(1, int(batch_size))
        self.identity = file_identity(self.path)

    def spec(self) -> dict:
        return {"preprocessor": self.name, "implementation": "transformers",
                "params": {"resolution": self.resolution, "dtype": self.dtype_name},
                "weights": self.identity, "libs": library_majors(("transformers", "torch"))}

    def compute(self, frames: np.ndarray) -> list[np.ndarray]:
        dtype = getattr(torch, self.dtype_name)
        model, processor = _load(self.path, self.identity, str(self.device), dtype)
        metric = is_metric(model.config)
        kwargs = {}
        if self.resolution:
            kwargs["size"] = {"height": self.resolution, "width": self.resolution}
        out = []
        model.to(self.device)
        try:
            for s in range(0, len(frames), self.batch_size):
                chunk = [np.ascontiguousarray(f) for f in frames[s:s + self.batch_size]]
                inputs = processor(images=chunk, return_tensors="pt", **kwargs)
                pv = inputs["pixel_values"].to(self.device, dtype=dtype)
                with torch.inference_mode():
                    pred = model(pixel_values=pv).predicted_depth
                if pred.ndim == 4:
                    pred = pred[:, 0]
                for f, p in zip(chunk, pred):
                    out.append(depth_to_u8(p, f.shape[:2], metric))
        finally:
            if self.device.type != "cpu":
                model.to("cpu")  # keep VRAM free between runs; the CPU copy is reused
        return out
