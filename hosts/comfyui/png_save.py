"""Save Image (SD Accel)'s writer: the files ComfyUI's SaveImage writes (the same names in the same output folder,
the same 8-bit pixels, the prompt and workflow as the same PNG text chunks), at a compression level the user picks.
PNG is lossless at every level: a lower one only writes a larger file sooner. ComfyUI's SaveImage uses level 4,
its PreviewImage level 1. At levels 0 and 1 each image's rows are converted and compressed in stripes on parallel
threads (engine/png_encode.py), one image after another; at the others PIL's encoder (whose per-row filter
choice writes smaller files) encodes a batch's images in parallel threads. numpy, zlib and PIL's encoder release
the GIL, and the executor waits for the whole batch either way.
"""
import concurrent.futures
import json
import os

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from ...engine import png_encode

SAVEIMAGE_LEVEL = 4    # stock SaveImage's compress_level
DEFAULT_LEVEL = 1      # ComfyUI's PreviewImage's: about half of level 4's encoding time (bench/bench_png_save.py)
MAX_THREADS = 8
STRIPED_LEVEL = 1     # the fastest levels, where one image's stream is striped over threads


def save_images(images, filename_prefix, compress_level=DEFAULT_LEVEL, prompt=None, extra_pnginfo=None):
    """Writes `images` (ComfyUI's IMAGE, [B, H, W, C] in 0..1) to ComfyUI's output folder as SaveImage names them;
    returns SaveImage's UI list of {filename, subfolder, type}."""
    import folder_paths
    if len(images) == 0:
        return []
    folder, filename, counter, subfolder, _ = folder_paths.get_save_image_path(
        filename_prefix, folder_paths.get_output_directory(), images[0].shape[1], images[0].shape[0])
    metadata = _metadata(prompt, extra_pnginfo)
    names = ["%s_%05d_.png" % (filename.replace("%batch_num%", str(i)), counter + i) for i in range(len(images))]
    write_pngs(images, [os.path.join(folder, n) for n in names], metadata, compress_level)
    return [{"filename": n, "subfolder": subfolder, "type": "output"} for n in names]


def write_pngs(images, paths, metadata, compress_level):
    """Each image (a [H, W, C] tensor in 0..1) to its path as 8-bit PNG, converted as SaveImage converts it
    (x 255, clipped, truncated), with `metadata` ({keyword: text} or None) as text chunks."""
    threads = min(os.cpu_count() or 1, MAX_THREADS)
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="sd_accel_png") as pool:
        if compress_level <= STRIPED_LEVEL and all(png_encode.can_encode(tuple(im.shape)) for im in images):
            for image, path in zip(images, paths):
                data = png_encode.encode(png_encode.to_uint8(image, pool, threads), compress_level, metadata,
                                         pool, threads)
                with open(path, "wb") as f:
                    f.write(data)
            return
        info = png_info(metadata)

        def write(i):
            Image.fromarray(png_encode.to_uint8(images[i])).save(paths[i], pnginfo=info, compress_level=compress_level)
        list(pool.map(write, range(len(paths))))   # the first failure (disk full, say) is raised here


def png_info(metadata):
    """PIL's PngInfo of {keyword: text} (None for None): the chunks PIL's encoder writes."""
    if metadata is None:
        return None
    info = PngInfo()
    for key, text in metadata.items():
        info.add_text(key, text)
    return info


def _metadata(prompt, extra_pnginfo):
    """The text chunks SaveImage embeds ({keyword: text}: the prompt, then each extra_pnginfo entry: the workflow),
    unless ComfyUI runs with --disable-metadata (None)."""
    from comfy.cli_args import args
    if args.disable_metadata:
        return None
    text = {}
    if prompt is not None:
        text["prompt"] = json.dumps(prompt)
    for key, value in (extra_pnginfo or {}).items():
        text[key] = json.dumps(value)
    return text
