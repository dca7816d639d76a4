#!/usr/bin/env python3
"""What SaveImage's PNG encoding costs a user per image, and what its compression level would change (issue #21.4:
with SD Accel, SaveImage is 22-31% of an SD1.5 512² image's time through the server).

ComfyUI's SaveImage writes PNG at compress_level 4 with the prompt and workflow as text chunks; its PreviewImage
uses level 1. This times PIL's PNG encoder at levels 0, 1, 4 (SaveImage's), 6 and 9 on a photo-like image (smooth
gradients, edges and mild noise: random noise would not compress at all, a flat image far too well), with
metadata of a typical graph's size, and prints ms per image and the file size. Host CPU work only, so it runs on
any machine; the figures are this machine's CPU.

Then Save Image (SD Accel)'s writer (hosts/comfyui/png_save.write_pngs: SaveImage's conversion, the level it is
given; at level 1 each image's rows converted and compressed in stripes on parallel threads, at level 4 PIL's
encoder with a batch's images in parallel threads) against SaveImage's way (one image after another at level 4), per
batch size, in this process, files to a temporary folder; the pixels read back are checked equal.

  python3 bench/bench_png_save.py [--sizes 512,1024] [--batches 1,4] [--reps 5]
"""
import argparse
import importlib.util
import io
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from PIL import Image
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LEVELS = (0, 1, 4, 6, 9)
SAVEIMAGE_LEVEL = 4


def photo_like(size, seed=0):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    img = np.zeros((size, size, 3), np.float32)
    for c in range(3):
        for _ in range(6):
            fx, fy, ph = rng.uniform(0.5, 6, 2).tolist() + [rng.uniform(0, 6.3)]
            img[..., c] += np.sin(2 * np.pi * (fx * x + fy * y) + ph)
    img += ((x > 0.6) * 1.5 - (y < 0.3) * 1.0)[..., None]          # hard edges, as objects have
    img = (img - img.min()) / (img.max() - img.min()) * 255
    img += rng.normal(0, 4, img.shape)                            # sensor-like noise
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def metadata():
    """A typical graph's text chunks, {keyword: text} (as png_save's writer takes them)."""
    graph = {str(i): {"class_type": "Node%d" % i, "inputs": {"text": "a photo of a cat " * 8, "seed": i}}
             for i in range(12)}
    return {"prompt": json.dumps(graph), "workflow": json.dumps({"nodes": list(graph.values()) * 3})}


def time_level(img, level, reps, info):
    times, size = [], 0
    for _ in range(reps):
        buf = io.BytesIO()
        t0 = time.perf_counter()
        img.save(buf, format="PNG", pnginfo=png_save_module().png_info(info), compress_level=level)
        times.append(time.perf_counter() - t0)
        size = buf.tell()
    return statistics.median(times) * 1e3, size


def png_save_module():
    """hosts/comfyui/png_save.py under a package of the repo's own (it imports nothing of ComfyUI at module level)."""
    import types
    if "sd_accel" not in sys.modules:
        pkg = types.ModuleType("sd_accel")
        pkg.__path__ = [REPO]
        sys.modules["sd_accel"] = pkg
    return importlib.import_module("sd_accel.hosts.comfyui.png_save")


def saveimage_way(images, paths, text):
    """What SaveImage does per image: the same conversion, level 4, one after another."""
    info = png_save_module().png_info(text)
    for image, path in zip(images, paths):
        img = Image.fromarray(np.clip(255. * image.cpu().numpy(), 0, 255).astype(np.uint8))
        img.save(path, pnginfo=info, compress_level=SAVEIMAGE_LEVEL)


def time_batches(sizes, batches, reps, info):
    png_save = png_save_module()
    print("\nsize  batch  SaveImage's way ms   SD Accel's writer ms at level 4 / %d   (per batch; %d CPUs)"
          % (png_save.DEFAULT_LEVEL, os.cpu_count()))
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            one = torch.from_numpy(np.asarray(photo_like(size), np.float32) / 255.)
            for batch in batches:
                images = torch.stack([torch.roll(one, 37 * i, 1) for i in range(batch)])
                ways = {"stock": lambda p: saveimage_way(images, p, info),
                        "ours4": lambda p: png_save.write_pngs(images, p, info, SAVEIMAGE_LEVEL),
                        "ours": lambda p: png_save.write_pngs(images, p, info, png_save.DEFAULT_LEVEL)}
                ms = {k: [] for k in ways}
                for r in range(reps):
                    for k, way in ways.items():   # interleaved, so a busy moment of the machine hits all alike
                        paths = [os.path.join(tmp, "%s_%d_%d.png" % (k, r, i)) for i in range(batch)]
                        t0 = time.perf_counter()
                        way(paths)
                        ms[k].append((time.perf_counter() - t0) * 1e3)
                for i in range(batch):
                    ref = np.asarray(Image.open(os.path.join(tmp, "stock_0_%d.png" % i)))
                    for k in ("ours4", "ours"):
                        assert np.array_equal(ref, np.asarray(Image.open(os.path.join(tmp, "%s_0_%d.png" % (k, i)))))
                med = {k: statistics.median(v) for k, v in ms.items()}
                nbytes = {k: sum(os.path.getsize(os.path.join(tmp, "%s_0_%d.png" % (k, i))) for i in range(batch))
                          for k in ways}
                print("%4d²  %5d  %18.1f   %10.1f / %.1f   (%.2fx / %.2fx of SaveImage's; files %.2fx / %.2fx)"
                      % (size, batch, med["stock"], med["ours4"], med["ours"], med["ours4"] / med["stock"],
                         med["ours"] / med["stock"], nbytes["ours4"] / nbytes["stock"],
                         nbytes["ours"] / nbytes["stock"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="512,1024")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    info = metadata()
    print("size   level   ms/image   KiB   vs SaveImage's level %d" % SAVEIMAGE_LEVEL)
    for size in (int(s) for s in a.sizes.split(",")):
        img = photo_like(size)
        rows = {lv: time_level(img, lv, a.reps, info) for lv in LEVELS}
        ref_ms, ref_size = rows[SAVEIMAGE_LEVEL]
        for lv, (ms, nbytes) in rows.items():
            print("%4d²  %5d   %8.1f  %5.0f   %.2fx time, %.2fx size"
                  % (size, lv, ms, nbytes / 1024, ms / ref_ms, nbytes / ref_size))
    time_batches([int(s) for s in a.sizes.split(",")], [int(b) for b in a.batches.split(",")], a.reps, info)


if __name__ == "__main__":
    main()
