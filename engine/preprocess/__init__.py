"""ControlNet condition-map preprocessors (canny, depth, pose), host-agnostic.

Each preprocessor is a small object with:
  - `name` ("canny", "depth", "pose") and `channels` (1 for grey maps, 3 for colour maps),
  - `spec()`: a JSON-able dict of everything that changes its output (implementation, parameters,
    weight-file identity, library major versions), used in the condition-cache key,
  - `compute(frames)`: uint8 RGB frames [B, H, W, 3] -> list of uint8 maps (H, W) or (H, W, 3),
    at the frames' own size.
Weights are located and checked when the object is built (cheap) and loaded only when `compute`
runs, so a fully cached batch never loads a model. `run()` drives a batch through the cache.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from .batch import MapReport, map_batch
from .condition_cache import ConditionCache

# Bump when the output of a preprocessor changes for the same inputs (part of every cache key).
PREPROCESS_CODE_VERSION = 1


class MissingWeightsError(FileNotFoundError):
    """Model weights are not on disk. The message names the files and where to put them."""

    def __init__(self, what: str, files: Sequence[str], folders: Sequence[str], hint: str = ""):
        self.files = list(files)
        self.folders = list(folders)
        where = folders[0] if folders else "(no model folder known)"
        msg = (f"SD Accel {what}: missing model file(s) {', '.join(self.files)}. Put them in {where}"
               + (f" (also searched: {', '.join(folders[1:])})" if len(folders) > 1 else "")
               + ". Nothing is downloaded at run time." + (f" {hint}" if hint else ""))
        super().__init__(msg)


def image_to_uint8(image: torch.Tensor) -> np.ndarray:
    """ComfyUI IMAGE float [B, H, W, C] in [0, 1] -> uint8 RGB [B, H, W, 3] (rounded, clamped).

    One channel is repeated, a fourth (alpha) channel is dropped."""
    x = image.detach()
    if x.ndim == 3:
        x = x.unsqueeze(0)
    if x.ndim != 4:
        raise ValueError(f"expected an IMAGE [B, H, W, C], got shape {tuple(image.shape)}")
    c = x.shape[-1]
    if c == 1:
        x = x.expand(*x.shape[:-1], 3)
    elif c == 4:
        x = x[..., :3]
    elif c != 3:
        raise ValueError(f"expected 1, 3 or 4 channels, got {c}")
    x = x.float().cpu().mul(255).round_().clamp_(0, 255).to(torch.uint8)
    return np.ascontiguousarray(x.numpy())


def run(pre, image: torch.Tensor, cache: ConditionCache | None = None,
        progress: Callable[[int, int], None] | None = None) -> tuple[torch.Tensor, MapReport]:
    """Condition maps for a ComfyUI IMAGE batch through `pre`, cached per frame when `cache` is given.

    Returns (IMAGE float32 [B, H, W, 3], MapReport(hits, misses, seconds, cache_bytes))."""
    if image.ndim == 3:
        image = image.unsqueeze(0)
    if image.ndim != 4:
        raise ValueError(f"expected an IMAGE [B, H, W, C], got shape {tuple(image.shape)}")
    spec = dict(pre.spec())
    spec.setdefault("preprocessor", pre.name)
    spec["code_version"] = PREPROCESS_CODE_VERSION
    n = int(image.shape[0])

    def compute(indices: list[int]):
        out = []
        for i in indices:  # frame by frame: bounded memory for long videos
            frame = image_to_uint8(image[i:i + 1])
            out.extend(pre.compute(frame))
            if progress is not None:
                progress(i, n)
        return out

    return map_batch(image, spec, compute, cache, channels=pre.channels, progress=progress)


def get_preprocessor(name: str, **params):
    """Build a preprocessor by name: "canny", "depth" or "pose" (see each module for parameters)."""
    if name == "canny":
        from .canny import CannyPreprocessor
        return CannyPreprocessor(**params)
    if name == "depth":
        from .depth import DepthPreprocessor
        return DepthPreprocessor(**params)
    if name == "pose":
        from .pose import PosePreprocessor
        return PosePreprocessor(**params)
    raise ValueError(f"unknown preprocessor {name!r} (expected canny, depth or pose)")
