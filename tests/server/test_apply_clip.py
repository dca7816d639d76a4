"""Apply SD Accel (CLIP) through the real ComfyUI server (CPU): in the shipped txt2img graph, between the loader's
CLIP and both text encoders, the prompt succeeds with stock's image byte for byte (on the CPU the node passes the
CLIP through) and the node's text says why no graph runs; CLIP Set Last Layer after it works as on the loader's CLIP."""
from workflow_util import psnr, run_image, txt2img

APPLY = "20"


def _graph(models, prefix, with_apply, after=None):
    wf = txt2img(models["sd15"], sampler="KSampler", seed=41, prefix=prefix)
    clip = ["4", 1]
    if with_apply:
        wf[APPLY] = {"class_type": "SDAccelApplyCLIP", "inputs": {"clip": clip, "cuda_graph": True}}
        clip = [APPLY, 0]
    if after == "clip_skip":
        wf["21"] = {"class_type": "CLIPSetLastLayer", "inputs": {"clip": clip, "stop_at_clip_layer": -2}}
        clip = ["21", 0]
    for n in ("6", "7"):
        wf[n]["inputs"]["clip"] = clip
    return wf


def test_the_node_between_loader_and_text_encoders_gives_stocks_image_and_says_why(comfy, models):
    stock, _ = run_image(comfy, _graph(models, "clip_stock", False))
    ours, entry = run_image(comfy, _graph(models, "clip_ours", True))
    assert psnr(ours, stock) == 99.0
    (line,) = entry["outputs"][APPLY]["text"]
    assert line == "text encoders: stock (cuda_graph: text encoder on cpu: CUDA graphs need a CUDA GPU)", line


def test_clip_set_last_layer_after_the_node_works_as_on_the_loaders_clip(comfy, models):
    stock, _ = run_image(comfy, _graph(models, "clip_skip_stock", False, after="clip_skip"))
    ours, _ = run_image(comfy, _graph(models, "clip_skip_ours", True, after="clip_skip"))
    plain, _ = run_image(comfy, _graph(models, "clip_plain", False))
    assert psnr(ours, stock) == 99.0 and psnr(stock, plain) < 99.0, "CLIP Set Last Layer had no effect"
