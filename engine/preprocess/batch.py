"""A batch of frames through the condition cache: each frame's map from the cache where it is there, the
others computed in one call and stored, and the result always rebuilt from the uint8 maps, so hits and misses
give identical tensors.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from .cache_keys import frame_key
from .condition_cache import ConditionCache, as_u8_map, maps_to_image


@dataclass
class MapReport:
    hits: int
    misses: int
    seconds: float
    cache_bytes: int

    def ui(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "seconds": round(self.seconds, 4),
                "cache_bytes": self.cache_bytes}


def map_batch(image: torch.Tensor, spec: Mapping, compute: Callable[[list[int]], Sequence],
              cache: ConditionCache | None, channels: int,
              progress: Callable[[int, int], None] | None = None) -> tuple[torch.Tensor, MapReport]:
    """Condition maps for every frame of `image` [B, H, W, C], cached per frame.

    `compute(indices)` returns uint8 maps ((H, W) or (H, W, 3)) for those frames of `image`; it is
    called once with all the frames that missed. `cache=None` computes everything and stores nothing.
    The result is always rebuilt from the uint8 maps, so hits and misses give identical tensors."""
    t0 = time.perf_counter()
    n, h, w = int(image.shape[0]), int(image.shape[1]), int(image.shape[2])
    maps: list = [None] * n
    keys = [None] * n
    if cache is not None:
        for i in range(n):
            keys[i] = frame_key(image[i], spec)
            maps[i] = cache.get(keys[i], expect_hw=(h, w), expect_channels=channels)
            if progress is not None and maps[i] is not None:
                progress(i, n)
    todo = [i for i in range(n) if maps[i] is None]
    if todo:
        computed = compute(todo)
        if len(computed) != len(todo):
            raise RuntimeError(f"preprocessor returned {len(computed)} maps for {len(todo)} frames")
        for i, m in zip(todo, computed):
            m = as_u8_map(m)
            got = 1 if m.ndim == 2 else 3
            if tuple(m.shape[:2]) != (h, w) or got != channels:
                raise RuntimeError(f"preprocessor returned a {tuple(m.shape)} map for a {h}x{w} frame "
                                   f"({channels} channel(s) expected)")
            maps[i] = m
            if cache is not None:
                cache.put(keys[i], m, kind=str(spec.get("preprocessor", "")))
    out = maps_to_image(maps)
    hits = n - len(todo) if cache is not None else 0
    report = MapReport(hits, len(todo), time.perf_counter() - t0,
                       cache.total_bytes() if cache is not None else 0)
    return out, report
