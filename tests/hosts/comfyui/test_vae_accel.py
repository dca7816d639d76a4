"""The accelerated VAE copy (hosts/comfyui/vae_accel.py) on ComfyUI's own VAE object (comfy.sd.VAE: its patcher,
its decode/encode with their memory estimates and tiled paths), in-process on the CPU. By default a CPU VAE runs
its own modules (stock, bit for bit) and says why; with the kernels' interpreter and SDACCEL_EAGER_PATH=fused the
copy's patches are installed as on a GPU, its decode and encode run the fused kernels within fp32 noise of stock,
and ComfyUI puts the user's modules back when the user's VAE is used again."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from sd_accel.engine.graphs import eager
from sd_accel.engine.graphs.graphed_forward import GraphedForward
from sd_accel.hosts.comfyui import vae as host_vae
from sd_accel.hosts.comfyui import vae_accel

import comfy_inproc

OPTS = vae_accel.VAEOptions()


@pytest.fixture(autouse=True)
def _unload():
    yield
    import comfy.model_management as mm
    mm.unload_all_models()


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(eager, "FORCED_PATH", "fused")


def _latent():
    return torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(2))


def _pixels():
    return torch.rand(1, 16, 16, 3, generator=torch.Generator().manual_seed(4))


def _encode(vae, pixels):
    torch.manual_seed(0)   # ComfyUI 2024 samples the latent from the global generator
    return vae.encode(pixels)


def _ours_in_tree(vae):
    m = vae.first_stage_model
    return [n for n, mod in m.named_modules() if "sdaccel_mixin" in mod.__dict__] + \
        [n for n in ("decoder", "encoder") if isinstance(getattr(m, n).__dict__.get("forward"), GraphedForward)]


def test_on_the_cpu_the_vae_runs_its_own_modules_and_the_report_says_why():
    vae = comfy_inproc.tiny_vae(seed=1)
    acc, info = vae_accel.accelerate_vae(vae, OPTS)
    assert acc is vae and "VAE on cpu" in info["reasons"]["SD Accel"]
    with torch.inference_mode():
        ref = vae.decode(_latent())
        images, line, ui = host_vae.decode(vae, {"samples": _latent()})
    assert torch.equal(images, ref)
    assert "VAE on cpu: its own modules run" in line and ui["accel"]["ran"] == []


def test_forced_copy_runs_fused_and_comfy_restores_the_user_s_modules_after(forced):
    vae = comfy_inproc.tiny_vae(seed=1)
    own = dict(vae.__dict__)
    with torch.inference_mode():
        ref_img, ref_lat = vae.decode(_latent()), _encode(vae, _pixels())
        acc, info = vae_accel.accelerate_vae(vae, OPTS)
        assert acc is not vae and acc.first_stage_model is vae.first_stage_model and acc.patcher is not vae.patcher
        patched = set(acc.patcher.object_patches)
        assert {"decoder.forward", "encoder.forward", "decoder.up.0.block.1", "encoder.norm_out"} <= patched
        assert info["patched"] == {"vae_resnet_block": 10, "group_norm": 4}
        out = {}
        with vae_accel.measured(info, out):
            img, lat = acc.decode(_latent()), _encode(acc, _pixels())
        assert out["ran"] == ["fused kernels x34"], out   # 20 in the decoder, 14 in the encoder
        expected = {"cuda_graph decode (1 eager)": "no CUDA device", "cuda_graph encode (1 eager)": "no CUDA device"}
        no_graphs = vae_accel._no_graphs_reason(acc.patcher)
        if no_graphs:   # ComfyUI 2024
            expected["cuda_graph"] = no_graphs
        assert out["fell_back"].pop("channels_last").startswith("a float32 VAE keeps stock's layout"), out
        assert out["fell_back"] == expected
        for a, b in ((img, ref_img), (lat, ref_lat)):
            assert torch.allclose(a, b, atol=1e-4) and not torch.equal(a, b)
        assert _ours_in_tree(vae), "while the copy's patcher is loaded its modules are in the shared model"
        again = vae.decode(_latent()), _encode(vae, _pixels())
    assert not _ours_in_tree(vae), "loading the user's patcher restored the original modules"
    assert torch.equal(again[0], ref_img) and torch.equal(again[1], ref_lat)
    assert vae.__dict__ == own and not vae.patcher.object_patches, "the user's VAE object is untouched"


def test_copies_are_cached_per_vae_and_options_and_a_copy_is_accelerated_from_its_original(forced):
    vae = comfy_inproc.tiny_vae(seed=1)
    acc, _ = vae_accel.accelerate_vae(vae, OPTS)
    assert vae_accel.accelerate_vae(vae, OPTS)[0] is acc
    assert vae_accel.accelerate_vae(acc, OPTS)[0] is acc and vae_accel.original_of(acc) is vae
    no_graphs = vae_accel.accelerate_vae(acc, vae_accel.VAEOptions(cuda_graph=False))[0]
    assert no_graphs is not acc and vae_accel.original_of(no_graphs) is vae
    off, info = vae_accel.accelerate_vae(vae, vae_accel.VAEOptions(False, False, False))
    assert off is vae and info["reasons"] == {"SD Accel": "all options off"}


def test_a_tiled_decode_calls_the_copy_s_decoder_per_tile(forced):
    vae = comfy_inproc.tiny_vae(seed=1)
    acc, info = vae_accel.accelerate_vae(vae, vae_accel.VAEOptions(fused_kernels=False, channels_last=False))
    assert set(acc.patcher.object_patches) == {"decoder.forward", "encoder.forward"}
    graphs = info["forwards"]["decode"].graphs
    calls = graphs.stats["eager"]
    with torch.inference_mode():
        ref = vae.decode_tiled(_latent(), tile_x=8, tile_y=8, overlap=2)
        img = acc.decode_tiled(_latent(), tile_x=8, tile_y=8, overlap=2)
    assert torch.equal(img, ref), "the host's own modules behind the graph stand-in: stock, bit for bit"
    assert graphs.stats["eager"] - calls >= 3, "every tile went through the decoder's stand-in"


def test_a_call_keeps_its_graph_only_where_its_memory_is_a_small_share_of_the_gpu():
    refusal = vae_accel.graph_memory_refusal
    assert refusal("decode", need=2 * 2 ** 30, total=141 * 2 ** 30, budgeted=False) is None
    why = refusal("decode", need=5 * 2 ** 30, total=24 * 2 ** 30, budgeted=False)
    assert "keeps ~5.0 GiB reserved" in why and "1/8 of the GPU's 24 GiB" in why
    assert "budget" in refusal("encode", need=1, total=141 * 2 ** 30, budgeted=True)


def test_a_model_that_is_not_an_image_autoencoder_is_left_as_it_is(forced):
    vae = comfy_inproc.tiny_vae(seed=1)
    vae.first_stage_model.decoder.conv_in = torch.nn.Identity()   # as a video VAE's 3-D convolution would
    acc, info = vae_accel.accelerate_vae(vae, OPTS)
    assert acc is vae and "not an image AutoencoderKL" in info["reasons"]["SD Accel"]


def test_a_tiled_decode_on_the_fused_copy_matches_stock_s_tiled_decode_within_fp32_noise(forced):
    vae = comfy_inproc.tiny_vae(seed=1)
    acc, info = vae_accel.accelerate_vae(vae, OPTS)
    lat = torch.randn(1, 4, 12, 10, generator=torch.Generator().manual_seed(6))   # edge tiles of other shapes
    with torch.inference_mode():
        ref = vae.decode_tiled(lat, tile_x=8, tile_y=8, overlap=2)
        out = {}
        with vae_accel.measured(info, out):
            img = acc.decode_tiled(lat, tile_x=8, tile_y=8, overlap=2)
    assert img.shape == ref.shape and torch.allclose(img, ref, atol=1e-4) and not torch.equal(img, ref)
    assert out["ran"] and out["ran"][0].startswith("fused kernels x"), out


def _tile_shapes(vae, lat, **tiling):
    shapes = set()
    hook = vae.first_stage_model.decoder.register_forward_pre_hook(lambda m, a: shapes.add(tuple(a[0].shape)))
    try:
        with torch.inference_mode():
            vae.decode_tiled(lat, **tiling)
    finally:
        hook.remove()
    return shapes


@pytest.mark.parametrize("latent_hw", [(128, 128), (152, 104), (200, 120)])   # 1024², 1216x832, 1600x960
def test_every_tile_shape_of_comfyui_s_tiled_decode_keeps_its_graph(latent_hw):
    # VAE Decode (Tiled) at its default tile size and overlap on this ComfyUI, and the tiling of its retry
    # after an out-of-memory error (decode_tiled's own defaults)
    vae = comfy_inproc.tiny_vae(seed=1)
    lat = torch.zeros((1, 4) + latent_hw)
    import nodes
    node_defaults = nodes.VAEDecodeTiled.INPUT_TYPES()["required"]
    tile = node_defaults["tile_size"][1]["default"] // 8
    overlap = node_defaults.get("overlap", ("INT", {"default": 128}))[1]["default"] // 8
    for tiling in ({"tile_x": tile, "tile_y": tile, "overlap": overlap}, {}):
        shapes = _tile_shapes(vae, lat, **tiling)
        assert 4 <= len(shapes) <= vae_accel.MAX_SHAPES, (tiling, sorted(shapes))


def test_graphs_are_kept_only_on_a_comfyui_that_says_when_it_unloads_the_vae(forced):
    vae = comfy_inproc.tiny_vae(seed=1)
    acc, info = vae_accel.accelerate_vae(vae, OPTS)
    why = vae_accel._no_graphs_reason(acc.patcher)
    import comfy.model_patcher as mp
    if hasattr(mp.ModelPatcher, "add_callback_with_key"):
        import comfy.patcher_extension as pe
        assert why is None
        assert acc.patcher.get_all_callbacks(pe.CallbacksMP.ON_DETACH), "the graphs' memory goes with the VAE"
    else:
        assert "no ON_DETACH callbacks" in why


def test_with_channels_last_weights_the_fused_copy_still_matches_stock_through_every_layer(forced):
    # what the first GPU call does to an fp16/bf16 VAE's decoder and encoder conv weights; the CPU's convolutions
    # then carry channels_last activations too, through the attention block's reshapes and the upsampling
    vae = comfy_inproc.tiny_vae(seed=1)
    with torch.inference_mode():
        ref_img, ref_lat = vae.decode(_latent()), _encode(vae, _pixels())
    acc, info = vae_accel.accelerate_vae(vae, OPTS)
    from sd_accel.engine.patches import patching
    for gf in info["forwards"].values():
        assert not gf.channels_last, "an fp32 VAE keeps stock's layout by default"
        assert patching.convert_conv_weights(gf.module) > 0
    layouts = []
    attn = vae.first_stage_model.decoder.mid.attn_1
    hook = attn.register_forward_pre_hook(
        lambda m, a: layouts.append(a[0].is_contiguous(memory_format=torch.channels_last)))
    try:
        with torch.inference_mode():
            img, lat = acc.decode(_latent()), _encode(acc, _pixels())
    finally:
        hook.remove()
    assert layouts == [True], "the decoder ran on channels_last activations"
    assert torch.allclose(img, ref_img, atol=1e-4) and torch.allclose(lat, ref_lat, atol=1e-4)


def test_a_stock_vae_decode_after_ours_runs_on_stock_s_layout(forced, monkeypatch):
    # an fp16/bf16 VAE on a GPU: the copy converts the conv weights (the user's VAE's) to channels_last for its
    # decode and puts them back when the decode returns (ComfyUI's ON_DETACH callback, when it loads the user's VAE
    # for a stock VAE Decode, would too), and the next decode of ours converts them again; an older ComfyUI keeps
    # stock's layout throughout
    monkeypatch.setattr(vae_accel, "_half_precision", lambda vae: True)
    vae = comfy_inproc.tiny_vae(seed=1)
    acc, info = vae_accel.accelerate_vae(vae, OPTS)
    gf = info["forwards"]["decode"]
    import comfy.model_patcher as mp
    if not hasattr(mp.ModelPatcher, "add_callback_with_key"):
        assert not gf.channels_last and "no ON_DETACH callbacks" in info["reasons"]["channels_last"]
        return
    assert gf.channels_last and "channels_last" not in info["reasons"]
    seen = []
    conv = vae.first_stage_model.decoder.conv_in
    hook = conv.register_forward_pre_hook(lambda m, a: seen.append(m.weight.is_contiguous()))
    try:
        with torch.inference_mode():
            ref = vae.decode(_latent())
            gf._to_channels_last()   # what its first GPU call does (the CPU has none)
            out = acc.decode(_latent())
            assert conv.weight.is_contiguous(), "our decode returned with the user's weights in channels_last"
            again = vae.decode(_latent())
    finally:
        hook.remove()
    assert seen == [True, False, True], seen
    assert torch.allclose(out, ref, atol=1e-4) and torch.equal(again, ref)
    assert gf.relayout_pending, "our next GPU decode converts them again before a graph replays"


def test_with_graphs_off_each_decode_still_runs_on_channels_last_and_the_report_says_so(forced, monkeypatch):
    """The VAE nodes with cuda_graph off keep channels_last: each decode converts the conv weights first and puts
    them back after, and the report names it as with graphs (it used to list channels_last only beside a graph's
    replays or refusals, so a run without graphs hid it). ComfyUI 2024 (no ON_DETACH callbacks): no channels_last,
    and the report says why."""
    from sd_accel.engine.graphs import graphed_forward
    monkeypatch.setattr(vae_accel, "_half_precision", lambda vae: True)
    # the CPU stands in for the GPU's first-call relayout (it has no CUDA to ask whether a capture is running)
    monkeypatch.setattr(graphed_forward, "GRAPH_DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    vae = comfy_inproc.tiny_vae(seed=1)
    acc, info = vae_accel.accelerate_vae(vae, vae_accel.VAEOptions(cuda_graph=False))
    import comfy.model_patcher as mp
    relayouts = hasattr(mp.ModelPatcher, "add_callback_with_key")
    # no graphs and no channels_last: the decoder keeps its own forward
    assert [gf.cuda_graph for gf in info["forwards"].values()] == ([False, False] if relayouts else []), info
    conv = vae.first_stage_model.decoder.conv_in
    seen = []
    hook = conv.register_forward_pre_hook(lambda m, a: seen.append(m.weight.is_contiguous()))
    rep = {}
    try:
        with torch.inference_mode():
            ref = vae.decode(_latent())
            with vae_accel.measured(info, rep):
                out = acc.decode(_latent())
    finally:
        hook.remove()
    assert torch.allclose(out, ref, atol=1e-4)
    assert conv.weight.is_contiguous(), "the decode returned with the user's weights in channels_last"
    if not relayouts:
        assert seen == [True, True] and "no ON_DETACH callbacks" in rep["fell_back"]["channels_last"], rep
        assert not any(r.startswith("channels_last") for r in rep["ran"]), rep
        return
    assert seen == [True, False], "our decode did not run on channels_last weights"
    assert "channels_last (decode)" in rep["ran"], rep["line"]
    assert rep["fell_back"].get("cuda_graph") == "off" and not any(r.startswith("cuda_graph") for r in rep["ran"])


@pytest.mark.parametrize("method", ["decode", "decode_tiled", "encode", "encode_tiled"])
def test_vae_save_after_ours_finds_the_user_s_weights_in_stock_s_layout(forced, monkeypatch, tmp_path, method):
    """VAE Save reads the VAE's state dict without loading it, and safetensors refuses a channels_last (non-contiguous)
    tensor: every decode and encode of the copy, whole or tiled, returns with the weights in stock's layout. A
    copy of the copy (copy.copy, as a node may make) does the same. ComfyUI 2024 (no ON_DETACH callbacks): the copy
    never converts them, and the save works the same."""
    monkeypatch.setattr(vae_accel, "_half_precision", lambda vae: True)
    vae = comfy_inproc.tiny_vae(seed=1)
    acc, info = vae_accel.accelerate_vae(vae, OPTS)
    import comfy.model_patcher as mp
    relayouts = hasattr(mp.ModelPatcher, "add_callback_with_key")
    assert [gf.channels_last for gf in info["forwards"].values()] == [relayouts, relayouts], info["reasons"]
    import copy
    import comfy.utils
    for target in (acc, copy.copy(acc)):
        for gf in info["forwards"].values():
            gf._to_channels_last()   # what a GPU call does first (the CPU has none); a no-op where channels_last is off
        assert all(t.is_contiguous() for t in vae.get_sd().values()) != relayouts
        with torch.inference_mode():
            if method.startswith("decode"):
                # two of ComfyUI's three passes tile (half the latent one way, all of it the other); smaller tiles
                # test nothing more and cost the interpreted kernels minutes on this CPU
                out = getattr(target, method)(_latent(), **({"tile_x": 8, "tile_y": 8, "overlap": 2}
                                                            if method == "decode_tiled" else {}))
            else:
                out = getattr(target, method)(_pixels(), **({"tile_x": 16, "tile_y": 16, "overlap": 4}
                                                             if method == "encode_tiled" else {}))
        assert torch.isfinite(out).all()
        sd = vae.get_sd()
        assert all(t.is_contiguous() for t in sd.values()), [k for k, t in sd.items() if not t.is_contiguous()]
        comfy.utils.save_torch_file(sd, str(tmp_path / "vae.safetensors"))   # what VAE Save does
        assert all(gf.relayout_pending for gf in info["forwards"].values() if gf.channels_last)
