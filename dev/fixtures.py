#!/usr/bin/env python3
"""Seeded random-weight checkpoints in the original single-file layouts that ComfyUI loads.

No weights can be downloaded here, so the demo, the tests and the GPU benchmark build their own:
  sd15   SD1.5 checkpoint (`model.diffusion_model.*`, `cond_stage_model.*`, `first_stage_model.*`)
  sdxl   SDXL checkpoint (full size; for the GPU machine)
  cn15   SD1.5 ControlNet (`control_model.*`), matching an SD1.5 UNet preset
  lora15 SD1.5 LoRA in kohya naming (`lora_unet_<path>.lora_up/lora_down/alpha`)
  iclight15  IC-Light fc offsets (8 input channels, ldm keys) for an SD1.5 UNet preset, as its nodes read them
  taesd  TAESD decoder, the live-preview decoder of `--preview-method taesd` (models/vae_approx; one
         architecture for SD1.5 and SDXL: save it as taesd_decoder.safetensors or taesdxl_decoder.safetensors)

ComfyUI detects SD1.5 from model_channels 320, context_dim 768, conv proj_in and no label_emb; channel
counts per level, res blocks and transformer depths are read from the weights, so reduced UNets load
as SD15 too. CLIP and the VAE are built from fixed configs in ComfyUI and must be full size.
The modules are built on the meta device from ComfyUI's own classes and its own key conversion, so
the layout is exactly the one ComfyUI expects; values are fan-in-scaled normals (finite in fp16).

Usage: python dev/fixtures.py --comfy-dir DIR --kind sd15 --preset small --out FILE
"""
import argparse
import math
import os
import sys
import time

UNET_PRESETS = {
    # levels (channel_mult), res blocks per level, transformer depth per level
    "tiny": ([1], 1, [1]),
    "small": ([1, 2], 1, [1, 1]),
    "small_plain_deep": ([1, 2], 1, [1, 0]),   # its deepest level without attention, as SD1.5's
    "sd15": ([1, 2, 4, 4], 2, [1, 1, 1, 0]),
}
VAE_DDCONFIG = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
SDXL_UNET = {"use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
             "legacy": False, "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4,
             "model_channels": 320, "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10],
             "channel_mult": [1, 2, 4], "transformer_depth_middle": 10, "use_linear_in_transformer": True,
             "context_dim": 2048, "num_head_channels": 64, "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
             "use_temporal_attention": False, "use_temporal_resblock": False}
# Layers a LoRA adapts: attention projections and the GEGLU input projection (which SD Accel replaces,
# so the LoRA test proves the replacement keeps parameter names).
LORA_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn2.to_q", "attn2.to_v", "attn1.to_out.0",
                "ff.net.0.proj", "ff.net.2")


def sd15_unet_config(preset):
    mult, nrb, depth = UNET_PRESETS[preset]
    tdepth, tdepth_out = [], []
    for d in depth:
        tdepth += [d] * nrb
        tdepth_out += [d] * (nrb + 1)
    return {"use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
            "legacy": False, "adm_in_channels": None, "in_channels": 4, "model_channels": 320,
            "num_res_blocks": [nrb] * len(mult), "transformer_depth": tdepth, "channel_mult": mult,
            "transformer_depth_middle": max(depth), "use_linear_in_transformer": False, "context_dim": 768,
            "num_heads": 8, "transformer_depth_output": tdepth_out,
            "use_temporal_attention": False, "use_temporal_resblock": False}


def _import_comfy(comfy_dir):
    comfy_dir = os.path.abspath(comfy_dir)
    if comfy_dir not in sys.path:
        sys.path.insert(0, comfy_dir)
    import comfy.cli_args
    import torch
    if not torch.cuda.is_available():
        comfy.cli_args.args.cpu = True  # before comfy.model_management is imported
    import comfy.model_detection  # noqa: F401
    import comfy.ops  # noqa: F401
    return comfy


def _model_config(comfy, unet_config):
    import inspect
    fn = comfy.model_detection.model_config_from_unet_config
    if len(inspect.signature(fn).parameters) > 1:   # current ComfyUI also takes the state dict
        return fn(dict(unet_config), None)
    return fn(dict(unet_config))


def _random(name, t, gen):
    """Finite, fan-in-scaled values; norm scales 1; small biases; integer tensors kept or ranged."""
    import torch
    if t.device.type != "meta":
        return t.detach().cpu().contiguous()
    shape = tuple(t.shape)
    if not t.dtype.is_floating_point:
        if name.endswith("position_ids"):
            return torch.arange(shape[-1], dtype=t.dtype).expand(shape).contiguous()
        return torch.zeros(shape, dtype=t.dtype)
    if len(shape) >= 2:
        out = torch.randn(shape, generator=gen).mul_(1.0 / math.sqrt(max(1, math.prod(shape[1:]))))
    elif len(shape) == 1 and name.endswith("weight"):
        out = torch.ones(shape)
    elif len(shape) == 0:
        out = torch.ones(shape)
    else:
        out = torch.randn(shape, generator=gen).mul_(0.01)
    return out


def _save(sd, path, dtype, meta):
    import safetensors.torch
    import torch
    out = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    safetensors.torch.save_file(out, tmp, metadata={k: str(v) for k, v in meta.items()})
    os.replace(tmp, path)   # atomic: a killed build never leaves a half-written cached checkpoint
    return sum(v.numel() for v in out.values() if v.is_floating_point()) if torch else 0


def build_checkpoint(comfy_dir, kind, preset, path, seed=0, dtype="fp16"):
    comfy = _import_comfy(comfy_dir)
    import torch
    import comfy.ldm.models.autoencoder as ae
    cfg = dict(SDXL_UNET if kind == "sdxl" else sd15_unet_config(preset))
    mc = _model_config(comfy, cfg)
    want = "SDXL" if kind == "sdxl" else "SD15"
    if type(mc).__name__ != want:
        raise RuntimeError("ComfyUI matched %s, expected %s" % (type(mc).__name__, want))
    with torch.device("meta"), torch.inference_mode():
        unet = mc.get_model({}, "").diffusion_model.state_dict()
        ct = mc.clip_target()
        clip = ct.clip(device="meta", dtype=torch.float16, **ct.params).state_dict()
        vae = ae.AutoencoderKL(ddconfig=VAE_DDCONFIG, embed_dim=4).state_dict()
    full = {}
    full.update(mc.process_unet_state_dict_for_saving(unet))
    full.update(mc.process_clip_state_dict_for_saving(clip))
    full.update(mc.process_vae_state_dict_for_saving(vae))
    gen = torch.Generator().manual_seed(seed)
    sd = {k: _random(k, full[k], gen) for k in sorted(full)}
    return _save(sd, path, torch.float16 if dtype == "fp16" else torch.float32,
                 {"sd_accel_fixture": kind, "preset": preset, "seed": seed})


def _unet_state(comfy_dir, preset, in_channels, seed):
    comfy = _import_comfy(comfy_dir)
    import torch
    config = dict(sd15_unet_config(preset), in_channels=in_channels)
    # ComfyUI's detection takes 8 input channels for another model (Stable Zero123, InstructPix2Pix)
    mc = comfy.supported_models.SD15(config) if in_channels == 8 else _model_config(comfy, config)
    if type(mc).__name__ != "SD15":
        raise RuntimeError("ComfyUI matched %s, expected SD15" % type(mc).__name__)
    with torch.device("meta"), torch.inference_mode():
        unet = mc.get_model({}, "").diffusion_model.state_dict()
    gen = torch.Generator().manual_seed(seed)
    return {k: _random(k, unet[k], gen) for k in sorted(unet)}


def build_unet(comfy_dir, preset, path, in_channels=4, seed=0):
    """A diffusion-model-only file (UNETLoader's), SD1.5's layout at `preset`; `in_channels` 9 makes it an
    inpainting UNet (latent, mask and masked-image latent concatenated: ComfyUI reads the count from the first conv)."""
    import torch
    sd = _unet_state(comfy_dir, preset, in_channels, seed)
    return _save(sd, path, torch.float16, {"sd_accel_fixture": "unet15", "preset": preset, "seed": seed,
                                           "in_channels": in_channels})


# IC-Light's files are offsets its nodes add to the base model's weights: a fine-tune's small deltas, but for the
# input conv's new channels (the foreground latent's), which start from zero. Random offsets of a full weight's
# size make the patched UNet another, badly conditioned network: one that amplified a 1e-3 change of the prompt 24
# times over six steps (the plain UNet: once), so fp16's own rounding moved its image by 10-15%.
ICLIGHT_OFFSET_SCALE = 0.05


def build_iclight_offsets(comfy_dir, preset, path, seed=0):
    """An IC-Light fc file as kijai's loader reads it (ldm keys, 8 input channels), SD1.5's layout at `preset`:
    random offsets of `ICLIGHT_OFFSET_SCALE` times a weight's scale, the input conv's last 4 channels in full."""
    import torch
    sd = _unet_state(comfy_dir, preset, 8, seed)
    for k, v in sd.items():
        if v.is_floating_point():
            v *= ICLIGHT_OFFSET_SCALE
    conv = sd["input_blocks.0.0.weight"]
    conv[:, 4:] /= ICLIGHT_OFFSET_SCALE
    return _save(sd, path, torch.float16, {"sd_accel_fixture": "iclight15", "preset": preset, "seed": seed,
                                           "offset_scale": ICLIGHT_OFFSET_SCALE})


def random_vae(comfy_dir, seed=0, ddconfig=None, dtype=None):
    """A comfy.sd.VAE of random weights: SD's full-size AutoencoderKL (SD1.5's and SDXL's VAEs are this one
    architecture) read from a state dict as ComfyUI reads a VAE file, or `ddconfig`'s smaller one (8x still).
    `dtype`: the VAE's compute dtype (None: ComfyUI's choice for the device, as for a user's VAE)."""
    comfy = _import_comfy(comfy_dir)
    import torch
    import comfy.ldm.models.autoencoder as ae
    import comfy.sd
    cfg = dict(ddconfig or VAE_DDCONFIG)
    with torch.device("meta"):
        meta = ae.AutoencoderKL(ddconfig=cfg, embed_dim=4).state_dict()
    gen = torch.Generator().manual_seed(seed)
    sd = {k: _random(k, meta[k], gen) for k in sorted(meta)}
    config = None if ddconfig is None else {"params": {"ddconfig": cfg, "embed_dim": 4}}
    return comfy.sd.VAE(sd=sd, config=config, dtype=dtype)


def build_controlnet(comfy_dir, preset, path, seed=0, kind="sd15"):
    comfy = _import_comfy(comfy_dir)
    import torch
    import comfy.cldm.cldm
    cfg = dict(SDXL_UNET if kind == "sdxl" else sd15_unet_config(preset))
    cfg.pop("out_channels")
    for k in ("use_temporal_attention", "use_temporal_resblock"):
        cfg.pop(k, None)
    with torch.device("meta"):
        net = comfy.cldm.cldm.ControlNet(hint_channels=3, dtype=torch.float16,
                                         operations=comfy.ops.disable_weight_init, **cfg)
        sd = net.state_dict()
    gen = torch.Generator().manual_seed(seed)
    out = {"control_model." + k: _random(k, v, gen) for k, v in sorted(sd.items())}
    # ComfyUI initialises zero convs to zero; random ones make the ControlNet visibly change the image.
    return _save(out, path, torch.float16, {"sd_accel_fixture": "cn_" + kind, "preset": preset, "seed": seed})


def union_controlnet(comfy_dir, preset, seed=0, control_types=8, dtype="float32"):
    """A random ControlNet Union (ControlNet++, as xinsir's SDXL ones: a task embedding per control type and a
    transformer layer that merges the hint's features with it) of `preset`'s SD1.5 layout, as ComfyUI's own loader
    builds one: its cldm ControlNet with `union_controlnet_num_control_type`, in its ControlNet object. Built in
    process, not written: ComfyUI recognises a union checkpoint only in the diffusers layout, whose key mapping it
    takes from a full-size SD1.5/SDXL config. None where this ComfyUI has no union ControlNet (2024)."""
    _import_comfy(comfy_dir)
    import inspect
    import torch
    import comfy.cldm.cldm
    import comfy.controlnet
    import comfy.model_management
    if "union_controlnet_num_control_type" not in inspect.signature(comfy.cldm.cldm.ControlNet).parameters:
        return None
    cfg = dict(sd15_unet_config(preset))
    cfg.pop("out_channels")
    for k in ("use_temporal_attention", "use_temporal_resblock"):
        cfg.pop(k, None)
    with torch.device("meta"):
        net = comfy.cldm.cldm.ControlNet(hint_channels=3, union_controlnet_num_control_type=control_types,
                                         dtype=getattr(torch, dtype), operations=comfy.ops.disable_weight_init, **cfg)
    gen = torch.Generator().manual_seed(seed)
    sd = {k: _random(k, v, gen) for k, v in sorted(net.state_dict().items())}
    net = net.to_empty(device="cpu")
    net.load_state_dict(sd)     # copied into the parameters' dtype
    return comfy.controlnet.ControlNet(net, load_device=comfy.model_management.get_torch_device(),
                                       manual_cast_dtype=None)


def build_t2i_adapter(comfy_dir, path, seed=0):
    """A full T2I adapter for SD1.5 (ComfyUI's `Adapter`: 8x8 pixel-unshuffled RGB hint in, a feature map for each
    of the UNet's four levels out, added to its input blocks), laid out as the published adapters are, which
    ComfyUI's ControlNetLoader recognises by its keys. Needs the full SD1.5 layout: the features are placed by the
    input blocks of SD1.5's four levels."""
    _import_comfy(comfy_dir)
    import torch
    import comfy.t2i_adapter.adapter as adapter
    with torch.device("meta"):
        sd = adapter.Adapter(cin=3 * 64, channels=[320, 640, 1280, 1280], nums_rb=2, ksize=1, sk=True, use_conv=False,
                             xl=False).state_dict()
    gen = torch.Generator().manual_seed(seed)
    out = {k: _random(k, v, gen) for k, v in sorted(sd.items())}
    return _save(out, path, torch.float16, {"sd_accel_fixture": "t2i_adapter_sd15", "seed": seed})


def build_lora(comfy_dir, preset, path, rank=4, seed=0, scale=0.5):
    """Random kohya-style LoRA over LORA_TARGETS of an SD1.5 UNet preset."""
    comfy = _import_comfy(comfy_dir)
    import torch
    mc = _model_config(comfy, sd15_unet_config(preset))
    with torch.device("meta"):
        unet = mc.get_model({}, "").diffusion_model
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, mod in unet.named_modules():
        if not name.endswith(LORA_TARGETS) or getattr(mod, "weight", None) is None:
            continue
        w = mod.weight
        if w.ndim != 2:
            continue
        key = "lora_unet_" + name.replace(".", "_")
        out[key + ".lora_down.weight"] = torch.randn(rank, w.shape[1], generator=gen) / math.sqrt(w.shape[1])
        out[key + ".lora_up.weight"] = torch.randn(w.shape[0], rank, generator=gen) * scale
        out[key + ".alpha"] = torch.tensor(float(rank))
    if not out:
        raise RuntimeError("no LoRA targets found")
    return _save(out, path, torch.float16, {"sd_accel_fixture": "lora15", "preset": preset, "seed": seed})


CLIP_L_LAYERS, CLIP_L_WIDTH = 12, 768
CLIP_LORA_SHAPES = {"self_attn_q_proj": (1, 1), "self_attn_k_proj": (1, 1), "self_attn_v_proj": (1, 1),
                    "self_attn_out_proj": (1, 1), "mlp_fc1": (4, 1), "mlp_fc2": (1, 4)}   # (out, in) in widths


def build_clip_lora(path, rank=4, seed=0, scale=0.5):
    """Random kohya-style LoRA over every layer of an SD1.5 checkpoint's CLIP-L text encoder (`lora_te_...` keys,
    as ComfyUI's LoraLoader maps them onto `clip_l.transformer.text_model.encoder.layers.*`)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(CLIP_L_LAYERS):
        for name, (o, n) in CLIP_LORA_SHAPES.items():
            key = "lora_te_text_model_encoder_layers_%d_%s" % (i, name)
            fan_in, fan_out = n * CLIP_L_WIDTH, o * CLIP_L_WIDTH
            out[key + ".lora_down.weight"] = torch.randn(rank, fan_in, generator=gen) / math.sqrt(fan_in)
            out[key + ".lora_up.weight"] = torch.randn(fan_out, rank, generator=gen) * scale
            out[key + ".alpha"] = torch.tensor(float(rank))
    return _save(out, path, torch.float16, {"sd_accel_fixture": "clip_lora15", "seed": seed})


def build_taesd(comfy_dir, path, seed=0):
    """Random TAESD decoder in ComfyUI's layout (comfy/taesd/taesd.py's `Decoder`, keys as it loads them)."""
    _import_comfy(comfy_dir)
    import torch
    import comfy.taesd.taesd as taesd
    with torch.device("meta"):
        sd = taesd.Decoder().state_dict()
    gen = torch.Generator().manual_seed(seed)
    out = {k: _random(k, v, gen) for k, v in sorted(sd.items())}
    return _save(out, path, torch.float16, {"sd_accel_fixture": "taesd", "seed": seed})


HYPERNETWORK_DIMS = (320, 640, 768, 1280)   # SD1.5's attention widths and its context width


def build_hypernetwork(path, seed=0, scale=0.5):
    """Random hypernetwork in the A1111 format ComfyUI's HypernetworkLoader reads (comfy_extras/
    nodes_hypernetwork.py): per width a pair (k, v) of two Linear layers, width -> width/4 -> width, with ReLU
    between them, no layer norm and no dropout (ComfyUI builds its dropout layers in training mode)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    out = {"activation_func": "relu", "is_layer_norm": False, "use_dropout": False, "activate_output": False,
           "last_layer_dropout": False}
    for dim in HYPERNETWORK_DIMS:
        pair = []
        for _ in range(2):
            hidden = dim // 4
            pair.append({"linear.0.weight": torch.randn(hidden, dim, generator=gen) / math.sqrt(dim),
                         "linear.0.bias": torch.zeros(hidden),
                         "linear.1.weight": torch.randn(dim, hidden, generator=gen) * scale / math.sqrt(hidden),
                         "linear.1.bias": torch.zeros(dim)})
        out[dim] = pair
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save(out, path + ".tmp")
    os.replace(path + ".tmp", path)   # atomic, as _save
    return path


def ensure(path, builder, *args, **kw):
    """Build once; later calls (and later test runs) reuse the cached file."""
    if not os.path.exists(path):
        t0 = time.time()
        builder(*args, **kw)
        print("[fixtures] built %s in %.1fs" % (path, time.time() - t0), flush=True)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfy-dir", required=True)
    ap.add_argument("--kind", choices=["sd15", "sdxl", "cn15", "lora15", "taesd", "hypernet15",
                                                  "unet15", "unet15inpaint", "iclight15", "t2i15"],
                    required=True)
    ap.add_argument("--preset", choices=sorted(UNET_PRESETS), default="small")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.kind in ("sd15", "sdxl"):
        ensure(a.out, build_checkpoint, a.comfy_dir, a.kind, a.preset, a.out, a.seed)
    elif a.kind == "cn15":
        ensure(a.out, build_controlnet, a.comfy_dir, a.preset, a.out, a.seed)
    elif a.kind == "taesd":
        ensure(a.out, build_taesd, a.comfy_dir, a.out, a.seed)
    elif a.kind == "hypernet15":
        ensure(a.out, build_hypernetwork, a.out, a.seed)
    elif a.kind == "t2i15":
        ensure(a.out, build_t2i_adapter, a.comfy_dir, a.out, a.seed)
    elif a.kind in ("unet15", "unet15inpaint"):
        ensure(a.out, build_unet, a.comfy_dir, a.preset, a.out, 9 if a.kind == "unet15inpaint" else 4, a.seed)
    elif a.kind == "iclight15":
        ensure(a.out, build_iclight_offsets, a.comfy_dir, a.preset, a.out, a.seed)
    else:
        ensure(a.out, build_lora, a.comfy_dir, a.preset, a.out, seed=a.seed)


if __name__ == "__main__":
    main()
