"""bench_server.py's prompts: the shipped txt2img workflow (workflows/sd15_txt2img_accelerated.api.json) made into
each config's stock and accelerated graph, and the input images its ControlNet and img2img graphs load."""
import json
import os

import numpy as np
from PIL import Image

import comfy_bench as cb
import comfy_server

TXT2IMG = os.path.join(cb.REPO, "workflows", "sd15_txt2img_accelerated.api.json")
SAMPLER, DECODE, LATENT, POS_NODE, SAVE = "3", "8", "5", "6", "9"
HIRES_SAMPLER = "32"   # the hires fix's second sampler (_hires_with_a_patched_first_pass)
ACCEL_KEYS = ("fused_kernels", "cuda_graph", "channels_last")
DENOISE = 0.6
HIRES_SCALE, HIRES_DENOISE = 1.5, 0.5
HINT, SOURCE = "sdaccel_bench_hint_%d.png", "sdaccel_bench_source_%d.png"


def text(k):
    """A positive prompt of its own for timed prompt k (a repeated text is served from ComfyUI's cache)."""
    return "%s, study %d" % (cb.POS, k)


def sized(opt, cfg):
    family, size, batch, kind = cfg
    return (family, 64 if opt.smoke else size, batch, kind)


def graph(opt, cfg, names, variant, seed, positive, prefix):
    """The API prompt of one config: stock (KSampler, VAE Decode) or ours (Accelerated KSampler with its defaults,
    VAE Decode (SD Accel) unless --ours-decoder stock; Save Image (SD Accel) with --ours-saver sdaccel; the workflow's
    Apply SD Accel (CLIP) unless --ours-clip stock). Everything
    else is the same node for node."""
    family, size, batch, kind = cfg
    with open(TXT2IMG) as f:
        wf = json.load(f)
    wf["4"]["inputs"]["ckpt_name"] = names[family]
    wf[POS_NODE]["inputs"]["text"] = positive
    wf[LATENT]["inputs"].update(width=size, height=size, batch_size=batch)
    wf[SAVE]["inputs"]["filename_prefix"] = "%s_%s" % (prefix, kind)
    node = wf[SAMPLER]["inputs"]
    node.update(seed=seed, steps=opt.steps, cfg=7.0, sampler_name="euler", scheduler="normal")
    if variant == "stock" or opt.ours_clip == "stock":
        comfy_server.without_node_class(wf, "SDAccelApplyCLIP")
    if variant == "stock":
        wf[SAMPLER]["class_type"] = "KSampler"
        for k in ACCEL_KEYS:
            node.pop(k)
    else:
        if opt.ours_decoder == "sdaccel":
            wf[DECODE] = {"class_type": "SDAccelVAEDecode", "inputs": dict(wf[DECODE]["inputs"], budget_gib=0.0)}
        if opt.ours_saver == "sdaccel":   # its default compress_level (1; SaveImage's is 4)
            wf[SAVE]["class_type"] = "SDAccelSaveImage"
        if opt.ours_precision != "fp16":
            node["precision"] = opt.ours_precision
        if opt.ours_step_cache != "off":
            node["step_cache"] = opt.ours_step_cache
    if kind == "cn":
        _add_controlnet(wf, names["cn"], size)
    elif kind == "img2img":
        _img2img(wf, size, batch)
    elif kind == "hires_freeu":
        _hires_with_a_patched_first_pass(wf)
    return wf


def lossy_suffix(opt):
    """The config name's mark of the accelerated graph's LOSSY options (none by default)."""
    return (("_fp8" if opt.ours_precision == "fp8" else "")
            + ("_stepcache_" + opt.ours_step_cache.replace(" ", "").replace("-", "")
               if opt.ours_step_cache != "off" else ""))


def sampler_options(opt):
    """How the accelerated graph's sampler was set, for the record's notes."""
    lossy = [k for k, on in (("precision fp8, LOSSY", opt.ours_precision == "fp8"),
                             ("step_cache %s, LOSSY" % opt.ours_step_cache, opt.ours_step_cache != "off")) if on]
    return ", ".join(lossy) or "defaults"


PREVIEW_SWITCH_NODES = os.path.join(cb.REPO, "bench", "server_nodes", "sdaccel_bench_previews")


def switch_previews(wf, method):
    """`wf` with the sampler's model passed through the bench's preview switch (bench/server_nodes), which sets
    ComfyUI's preview method for this prompt."""
    wf["20"] = {"class_type": "SDAccelBenchPreviewMethod", "inputs": {"model": wf[SAMPLER]["inputs"]["model"],
                                                                     "method": method}}
    wf[SAMPLER]["inputs"]["model"] = ["20", 0]
    return wf


def _add_controlnet(wf, cn_name, size):
    wf["10"] = {"class_type": "LoadImage", "inputs": {"image": HINT % size}}
    wf["12"] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": cn_name}}
    wf["13"] = {"class_type": "ControlNetApplyAdvanced", "inputs": {
        "positive": [POS_NODE, 0], "negative": ["7", 0], "control_net": ["12", 0], "image": ["10", 0],
        "strength": 1.0, "start_percent": 0.0, "end_percent": 1.0}}
    wf[SAMPLER]["inputs"].update(positive=["13", 0], negative=["13", 1])


def _img2img(wf, size, batch):
    del wf[LATENT]
    wf["10"] = {"class_type": "LoadImage", "inputs": {"image": SOURCE % size}}
    wf["11"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["10", 0], "vae": ["4", 2]}}
    latent = ["11", 0]
    if batch > 1:
        wf["12"] = {"class_type": "RepeatLatentBatch", "inputs": {"samples": latent, "amount": batch}}
        latent = ["12", 0]
    wf[SAMPLER]["inputs"].update(latent_image=latent, denoise=DENOISE)


def _hires_with_a_patched_first_pass(wf):
    """A hires fix whose two samplers run two clones of one checkpoint: the first pass on a FreeU_V2 clone, the
    second (latent upscaled, denoise HIRES_DENOISE) on the plain model, each with the graph's own sampler class. Each
    prompt switches between the clones twice."""
    plain = wf[SAMPLER]["inputs"]["model"]
    wf["30"] = {"class_type": "FreeU_V2", "inputs": {"model": plain, "b1": 1.3, "b2": 1.4, "s1": 0.9, "s2": 0.2}}
    wf[SAMPLER]["inputs"]["model"] = ["30", 0]
    wf["31"] = {"class_type": "LatentUpscaleBy", "inputs": {"samples": [SAMPLER, 0], "upscale_method": "nearest-exact",
                                                           "scale_by": HIRES_SCALE}}
    second = json.loads(json.dumps(wf[SAMPLER]))
    second["inputs"].update(model=plain, latent_image=["31", 0], denoise=HIRES_DENOISE)
    wf[HIRES_SAMPLER] = second
    wf[DECODE]["inputs"]["samples"] = [HIRES_SAMPLER, 0]


def write_inputs(input_dir, configs, table, opt):
    """A ready edge map (white strokes on black, as a canny map looks) and a smooth picture for img2img, at each
    size the configs use, into the server's input folder."""
    for name in configs:
        family, size, batch, kind = sized(opt, table[name])
        yy, xx = np.mgrid[0:size, 0:size] / float(size)
        if kind == "cn":
            edges = (np.abs(np.sin(9 * xx + 4 * yy)) < 0.06) | (np.abs((xx - .5) ** 2 + (yy - .5) ** 2 - .09) < .004)
            img = np.repeat((edges * 255).astype(np.uint8)[..., None], 3, axis=2)
            Image.fromarray(img).save(os.path.join(input_dir, HINT % size))
        elif kind == "img2img":
            img = np.stack([xx, yy, 0.5 + 0.5 * np.sin(6 * xx * yy)], axis=2)
            Image.fromarray((img * 255).astype(np.uint8)).save(os.path.join(input_dir, SOURCE % size))


def psnr_of(stock_paths, ours_paths):
    """PSNR (dB) of ours' first saved image against stock's (the warm-up prompts: same seed and text), 8-bit PNGs."""
    import torch
    a, b = (torch.from_numpy(np.asarray(Image.open(p[0]).convert("RGB"), dtype=np.float32) / 255.0)
            for p in (stock_paths, ours_paths))
    return round(cb.psnr(a, b), 2)
