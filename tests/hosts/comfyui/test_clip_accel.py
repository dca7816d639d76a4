"""hosts/comfyui/clip_accel.py and Apply SD Accel (CLIP) in-process on ComfyUI's own CLIP (CPU: a random SD1.5
checkpoint's full-size CLIP-L, loaded by ComfyUI's loader).

On the CPU the node passes the CLIP through and says why. The patched copy itself (what a GPU gets) is checked
here too, on this ComfyUI: its object patch lands on the text encoder's layers while ComfyUI encodes with the copy
(the calls go through our stand-in, eagerly here), the conditioning is stock's bit for bit, and the user's CLIP in a
stock CLIP Text Encode afterwards runs its own modules again."""
import pytest
import torch

from sd_accel.engine.graphs.graphed_forward import GraphedForward
from sd_accel.hosts.comfyui import clip_accel
from sd_accel.nodes.clip_nodes import SDAccelApplyCLIP

import comfy_inproc


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return comfy_inproc.tiny_clip(tmp_path_factory.mktemp("ckpt"))


def _encode(clip, text):
    with torch.inference_mode():
        cond, extra = comfy_inproc.comfy_nodes().CLIPTextEncode().encode(clip, text)[0][0]
    return cond, extra["pooled_output"]


def _encoder(clip):
    return clip.cond_stage_model.clip_l.transformer.text_model.encoder


def test_on_the_cpu_the_node_passes_the_clip_through_and_says_why(clip):
    out = SDAccelApplyCLIP().apply(clip)
    assert out["result"][0] is clip
    (line,) = out["ui"]["text"]
    assert line == "text encoders: stock (cuda_graph: text encoder on cpu: CUDA graphs need a CUDA GPU)", line
    off = SDAccelApplyCLIP().apply(clip, cuda_graph=False)
    assert off["result"][0] is clip and off["ui"]["text"][0] == "text encoders: stock (cuda_graph: off)"


def test_the_patched_copy_runs_the_layers_through_our_forward_and_gives_stocks_conditioning(clip):
    ref = _encode(clip, "a photograph of an (astronaut:1.2) riding a horse")
    acc, info = clip_accel.patched_copy(clip)
    assert acc is not clip and acc.patcher is not clip.patcher and info["encoders"] == ["clip_l"]
    graphs = info["forwards"]["clip_l"].graphs
    calls = graphs.stats["eager"]
    seen = []
    real_run = graphs.run

    def run(fn, args, kwargs, **kw):   # the stand-in's call, as the encode reaches it
        seen.append(isinstance(_encoder(acc).__dict__.get("forward"), GraphedForward))
        return real_run(fn, args, kwargs, **kw)
    graphs.run = run
    try:
        ours = _encode(acc, "a photograph of an (astronaut:1.2) riding a horse")
    finally:
        del graphs.run
    assert seen == [True] and graphs.stats["eager"] == calls + 1, (seen, graphs.stats)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    again = _encode(clip, "a photograph of an (astronaut:1.2) riding a horse")
    assert not isinstance(_encoder(clip).__dict__.get("forward"), GraphedForward), "our forward left on the user's CLIP"
    assert torch.equal(again[0], ref[0])


def test_weight_functions_on_the_layers_keep_the_call_out_of_graphs(clip):
    rule = clip_accel._weight_function_rule(_encoder(clip))
    assert rule((), {}) is None
    fc1 = _encoder(clip).layers[0].mlp.fc1
    fc1.weight_function = [lambda w: w]
    try:
        assert "low-VRAM LoRA patch" in rule((), {})
    finally:
        del fc1.weight_function
    assert rule((), {}) is None


def test_no_clip_text_encoder_is_named_as_the_reason():
    class NotClip(torch.nn.Module):
        pass
    patcher = type("P", (), {})()
    holder = type("C", (), {"clone": lambda self: self})()
    holder.cond_stage_model = patcher.model = NotClip()
    holder.patcher = patcher
    out, info = clip_accel.accelerate_clip(holder)
    assert out is holder and info["reasons"]["cuda_graph"].startswith("no CLIP text encoder in NotClip")


def test_on_a_cuda_text_encoder_graphs_need_a_comfyui_that_says_when_it_unloads_it(clip):
    """What the GPU tests cannot reach on ComfyUI 2024 (tests/gpu runs the current one): a text encoder whose
    patcher loads it on CUDA gets the graphs on a ComfyUI with ON_DETACH callbacks, and is passed through with that
    reason on one without (no CUDA is touched to decide)."""
    import comfy.model_patcher as mp
    on_cuda = clip.clone()
    on_cuda.patcher.load_device = torch.device("cuda", 0)
    out, info = clip_accel.accelerate_clip(on_cuda)
    if hasattr(mp.ModelPatcher, "add_callback_with_key"):
        import comfy.patcher_extension as pe
        assert out is not on_cuda and info["encoders"] == ["clip_l"] and not info["reasons"], info
        assert out.patcher.get_all_callbacks(pe.CallbacksMP.ON_DETACH), "the graphs' memory goes with the encoder"
    else:
        assert out is on_cuda and info["reasons"]["cuda_graph"].startswith("this ComfyUI has no ON_DETACH"), info
