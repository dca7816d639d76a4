"""Condition-map cache: hit time vs miss time for canny, depth and pose at 1024x1024 (CPU is fine).

    python bench/bench_condition_cache.py [--size 1024] [--repeat 5] [--no-real-depth]

Depth and pose run on the tiny random models from tests/tiny_models.py, so their miss is
cheap; the table therefore also splits a miss into its stages, and the model-free part (everything
but the network forward passes) is what a real model adds its forward time to. With
--real-depth (default) a random-weight Depth-Anything-V2-Small (24.8 M parameters, the real
architecture and input size) is built in a temp folder and timed as well.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import types

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if "sd_accel" not in sys.modules:  # the repo root is a package under whatever folder name it was cloned to
    pkg = types.ModuleType("sd_accel")
    pkg.__path__ = [REPO]
    sys.modules["sd_accel"] = pkg
sys.path.insert(0, os.path.join(REPO, "tests"))

from sd_accel.engine import preprocess as pp  # noqa: E402
from sd_accel.engine.preprocess.cache_keys import frame_key  # noqa: E402
from sd_accel.engine.preprocess.condition_cache import ConditionCache, maps_to_image  # noqa: E402
from sd_accel.engine.preprocess import depth as depth_mod  # noqa: E402
from sd_accel.engine.preprocess import pose as pose_mod  # noqa: E402
from sd_accel.engine.preprocess.pose_render import render  # noqa: E402


def photo(size: int) -> torch.Tensor:
    import skimage.data
    from PIL import Image
    rgb = np.asarray(Image.fromarray(skimage.data.astronaut()).resize((size, size), Image.BICUBIC))
    return torch.from_numpy(rgb.astype(np.float32) / 255)[None]


def timed(fn, repeat):
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1000


def miss_and_hit(pre, img, repeat, root):
    """Median ms of a full miss (empty cache: compute + write) and of a hit (hash + load + rebuild)."""
    n = [0]

    def miss():
        n[0] += 1
        pp.run(pre, img, ConditionCache(os.path.join(root, f"m{n[0]}")))

    pp.run(pre, img, None)  # warm up: model load, ORT session, allocator
    miss_ms = timed(miss, repeat)
    cache = ConditionCache(os.path.join(root, "hit"))
    pp.run(pre, img, cache)
    hit_ms = timed(lambda: pp.run(pre, img, cache), repeat)
    return miss_ms, hit_ms


def stage_table(stages):
    w = max(len(s) for s, _ in stages)
    return "\n".join(f"    {s:<{w}}  {ms:8.2f} ms" for s, ms in stages)


def depth_stages(pre, img, repeat, root):
    u8 = pp.image_to_uint8(img)
    model, proc = depth_mod._load(pre.path, pre.identity, "cpu", torch.float32)
    spec = pre.spec()
    pv = proc(images=[u8[0]], return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        pred = model(pixel_values=pv).predicted_depth
    m = depth_mod.depth_to_u8(pred[0], u8.shape[1:3], False)
    cache = ConditionCache(os.path.join(root, "stages_d"))
    key = frame_key(img[0], spec)

    def fwd():
        with torch.inference_mode():
            model(pixel_values=pv)
    stages = [
        ("key (sha256 of the float frame)", timed(lambda: frame_key(img[0], spec), repeat)),
        ("IMAGE -> uint8", timed(lambda: pp.image_to_uint8(img), repeat)),
        ("image processor", timed(lambda: proc(images=[u8[0]], return_tensors="pt"), repeat)),
        ("model forward  [not model-free]", timed(fwd, repeat)),
        ("resize + min-max + uint8", timed(lambda: depth_mod.depth_to_u8(pred[0], u8.shape[1:3], False), repeat)),
        ("cache write (torch.save, fsync, replace)", timed(lambda: cache.put(key, m), repeat)),
        ("cache read (load + validate)", timed(lambda: cache.get(key), repeat)),
        ("uint8 -> IMAGE", timed(lambda: maps_to_image([torch.from_numpy(m)]), repeat)),
    ]
    return stages, f"processor output {tuple(pv.shape)}"


def pose_stages(pre, img, repeat, root):
    u8 = pp.image_to_uint8(img)[0]
    det = pose_mod._session(pre.detector_path, None)
    pose = pose_mod._session(pre.pose_path, None)
    in_h, in_w = pose_mod._input_hw(det, (640, 640))
    padded, _ = pose_mod.letterbox(u8, in_h, in_w)
    x = padded.transpose(2, 0, 1)[None].astype(np.float32)
    boxes = pose_mod.detect_people(det, u8)
    ph, pw = pose_mod._input_hw(pose, (384, 288))
    c, s = pose_mod.box_to_center_scale(boxes[0], pw, ph)
    mtx = pose_mod.crop_matrix(c, s, pw, ph)
    crop = pose_mod.warp_affine(u8, mtx, pw, ph)
    px = ((crop - pose_mod.MEAN) / pose_mod.STD).transpose(2, 0, 1)[None].astype(np.float32)
    kps, scs = pose_mod.estimate_keypoints(pose, u8, boxes)
    people = pose_mod.to_people(kps, scs)
    m = render(u8.shape[0], u8.shape[1], people)
    spec = pre.spec()
    key = frame_key(img[0], spec)
    cache = ConditionCache(os.path.join(root, "stages_p"))
    stages = [
        ("key (sha256 of the float frame)", timed(lambda: frame_key(img[0], spec), repeat)),
        ("IMAGE -> uint8", timed(lambda: pp.image_to_uint8(img), repeat)),
        ("letterbox to detector input", timed(lambda: pose_mod.letterbox(u8, in_h, in_w), repeat)),
        ("detector forward  [not model-free]", timed(lambda: det.run(None, {det.get_inputs()[0].name: x}), repeat)),
        ("crop + normalise (per person)", timed(lambda: pose_mod.warp_affine(u8, mtx, pw, ph), repeat)),
        ("pose forward (per person)  [not model-free]",
         timed(lambda: pose.run(None, {pose.get_inputs()[0].name: px}), repeat)),
        ("render OpenPose image", timed(lambda: render(u8.shape[0], u8.shape[1], people), repeat)),
        ("cache write (torch.save, fsync, replace)", timed(lambda: cache.put(key, m), repeat)),
        ("cache read (load + validate)", timed(lambda: cache.get(key), repeat)),
        ("uint8 -> IMAGE", timed(lambda: maps_to_image([torch.from_numpy(m)]), repeat)),
    ]
    return stages, f"{len(boxes)} person(s)"


def make_real_size_depth(folder):
    """Random-weight Depth-Anything-V2-Small: the published config, no weights downloaded."""
    from transformers import (DepthAnythingConfig, DepthAnythingForDepthEstimation, Dinov2Config,
                              DPTImageProcessor)
    bb = Dinov2Config(image_size=518, patch_size=14, hidden_size=384, num_hidden_layers=12,
                      num_attention_heads=6, intermediate_size=1536, layerscale_value=1.0,
                      out_indices=[3, 6, 9, 12], reshape_hidden_states=False)
    cfg = DepthAnythingConfig(backbone_config=bb, neck_hidden_sizes=[48, 96, 192, 384], fusion_hidden_size=64,
                              head_hidden_size=32, reassemble_hidden_size=384, reassemble_factors=[4, 2, 1, 0.5])
    model = DepthAnythingForDepthEstimation(cfg)
    model.save_pretrained(folder)
    DPTImageProcessor(size={"height": 518, "width": 518}, keep_aspect_ratio=True, ensure_multiple_of=14,
                      resample=3, image_mean=[0.485, 0.456, 0.406],
                      image_std=[0.229, 0.224, 0.225]).save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-real-depth", action="store_true")
    args = ap.parse_args()
    from tiny_models import make_tiny_depth_model, make_tiny_pose_models

    torch.manual_seed(0)
    img = photo(args.size)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        make_tiny_depth_model(os.path.join(root, "tiny-da2"))
        make_tiny_pose_models(os.path.join(root, "pose"))
        pres = [("canny (cv2)", pp.get_preprocessor("canny", implementation="cv2")),
                ("canny (torch fallback)", pp.get_preprocessor("canny", implementation="torch")),
                ("depth (tiny DA2)", depth_mod.DepthPreprocessor(os.path.join(root, "tiny-da2"))),
                ("pose (tiny DWPose-format)", pose_mod.PosePreprocessor(search_dirs=[os.path.join(root, "pose")]))]
        if not args.no_real_depth:
            n = make_real_size_depth(os.path.join(root, "da2-small-random"))
            pres.append((f"depth (DA2-Small size, {n / 1e6:.1f} M, random)",
                         depth_mod.DepthPreprocessor(os.path.join(root, "da2-small-random"))))
        for name, pre in pres:
            miss, hit = miss_and_hit(pre, img, args.repeat, os.path.join(root, name.split()[0]))
            rows.append((name, miss, hit))
        d_stages, d_note = depth_stages(pres[2][1], img, args.repeat, root)
        p_stages, p_note = pose_stages(pres[3][1], img, args.repeat, root)

    print(f"\nCondition cache at {args.size}x{args.size}, median of {args.repeat}, torch threads "
          f"{torch.get_num_threads()}, CPU")
    print(f"{'preprocessor':<40} {'miss ms':>9} {'hit ms':>8} {'hit/miss':>9}")
    for name, miss, hit in rows:
        print(f"{name:<40} {miss:9.1f} {hit:8.1f} {100 * hit / miss:8.1f}%")
    for title, stages in ((f"depth miss, by stage (tiny model; {d_note})", d_stages),
                          (f"pose miss, by stage (tiny models; {p_note})", p_stages)):
        free = sum(ms for s, ms in stages if "not model-free" not in s and "cache read" not in s)
        print(f"\n{title}\n{stage_table(stages)}\n    model-free part of a miss: {free:.1f} ms")


if __name__ == "__main__":
    main()
