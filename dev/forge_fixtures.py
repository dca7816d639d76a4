#!/usr/bin/env python3
"""Test files for dev/forge_check.py, made from an SD1.5 checkpoint (run with a Python that has torch and
safetensors: the Forge venv):

  lora  CKPT OUT   a LoRA on exactly the modules SD Accel replaces in Forge: LyCORIS norm deltas
                   (`.w_norm`/`.b_norm`) on every LayerNorm and GroupNorm of the UNet, and a low-rank pair
                   (`lora_up`/`lora_down`) on every GEGLU projection (`ff.net.0.proj`), named the kohya way
                   (`lora_unet_<path with _>`), which Forge's LoRA loader maps to the UNet's keys
  ckpt2 CKPT OUT   the same checkpoint with every UNet weight perturbed (a second checkpoint of the same
                   config, for the checkpoint switch)
  controlnet CKPT OUT  a ControlNet of the checkpoint's UNet config, in the original (.pth-style) key layout
                   Forge's loader reads: the UNet's input blocks, middle block and time embedding, a random
                   hint encoder (3 -> 16 -> 32 -> 96 -> 256 -> model channels, stride 8) and random, not zero,
                   1x1 output convs, so the control visibly changes the image
Seeded: the same input gives the same files.
"""
import sys

import torch
from safetensors.torch import load_file, save_file

UNET = "model.diffusion_model."


def _norm_keys(sd):
    """UNet paths of the norms (1-D weight with a bias, under a `norm` name or a ResBlock's layer 0)."""
    out = []
    for k, v in sd.items():
        if not (k.startswith(UNET) and k.endswith(".weight") and v.dim() == 1):
            continue
        path = k[len(UNET):-len(".weight")]
        if ".norm" in "." + path or path.endswith(("in_layers.0", "out_layers.0")) or path == "out.0":
            out.append(path)
    return out


def make_lora(ckpt, out, seed=7, scale=0.5, rank=4):
    sd = load_file(ckpt)
    g = torch.Generator().manual_seed(seed)
    lora = {}
    for path in _norm_keys(sd):
        name = "lora_unet_" + path.replace(".", "_")
        w, b = sd[UNET + path + ".weight"].float(), sd[UNET + path + ".bias"].float()
        lora[name + ".w_norm"] = (scale * torch.randn(w.shape, generator=g)).half()
        lora[name + ".b_norm"] = (scale * torch.randn(b.shape, generator=g)).half()
    for k, w in sd.items():
        if k.startswith(UNET) and k.endswith("ff.net.0.proj.weight"):
            name = "lora_unet_" + k[len(UNET):-len(".weight")].replace(".", "_")
            std = w.float().std().item()
            lora[name + ".lora_down.weight"] = torch.randn(rank, w.shape[1], generator=g).half()
            lora[name + ".lora_up.weight"] = (std * torch.randn(w.shape[0], rank, generator=g) / rank).half()
            lora[name + ".alpha"] = torch.tensor(float(rank)).half()
    save_file(lora, out)
    return len(lora)


def make_second_checkpoint(ckpt, out, seed=11):
    sd = load_file(ckpt)
    g = torch.Generator().manual_seed(seed)
    for k, v in sd.items():
        if k.startswith(UNET) and v.is_floating_point():
            noise = torch.randn(v.shape, generator=g) * (v.float().std().item() or 0.02)
            sd[k] = (v.float() + 0.5 * noise).to(v.dtype)
    save_file(sd, out)
    return len(sd)


HINT_CHANNELS = (3, 16, 16, 32, 32, 96, 96, 256)   # the hint encoder's conv widths (cldm's), before model channels


def _conv(g, c_out, c_in, k, gain=1.0):
    w = torch.randn(c_out, c_in, k, k, generator=g) * (gain / (c_in * k * k) ** 0.5)
    return w.half(), (0.01 * torch.randn(c_out, generator=g)).half()


def _block_out_channels(sd, i):
    """Output channels of the UNet's input block i: its first conv, a ResBlock's last conv, or a downsample."""
    for key in ("input_blocks.%d.0.weight", "input_blocks.%d.0.out_layers.3.weight", "input_blocks.%d.0.op.weight"):
        w = sd.get(UNET + key % i)
        if w is not None:
            return w.shape[0]
    raise SystemExit("input block %d of the checkpoint: no conv found" % i)


def make_controlnet(ckpt, out, seed=13):
    sd = load_file(ckpt)
    g = torch.Generator().manual_seed(seed)
    cn = {"control_model." + k[len(UNET):]: v for k, v in sd.items()
          if k.startswith(UNET) and k[len(UNET):].startswith(("input_blocks.", "middle_block.", "time_embed."))}
    n_blocks = 1 + max(int(k[len(UNET):].split(".")[1]) for k in sd if k.startswith(UNET + "input_blocks."))
    widths = HINT_CHANNELS + (_block_out_channels(sd, 0),)
    for j in range(len(widths) - 1):
        w, b = _conv(g, widths[j + 1], widths[j], 3)
        cn["control_model.input_hint_block.%d.weight" % (2 * j)], cn["control_model.input_hint_block.%d.bias" % (2 * j)] = w, b
    for i in range(n_blocks):
        c = _block_out_channels(sd, i)
        cn["control_model.zero_convs.%d.0.weight" % i], cn["control_model.zero_convs.%d.0.bias" % i] = _conv(g, c, c, 1, 0.5)
    c = sd[UNET + "middle_block.2.out_layers.3.weight"].shape[0]
    cn["control_model.middle_block_out.0.weight"], cn["control_model.middle_block_out.0.bias"] = _conv(g, c, c, 1, 0.5)
    save_file(cn, out)
    return len(cn)


if __name__ == "__main__":
    what, src, dst = sys.argv[1:4]
    make = {"lora": make_lora, "ckpt2": make_second_checkpoint, "controlnet": make_controlnet}[what]
    n = make(src, dst)
    print("[fixtures] %s: %d tensors -> %s" % (what, n, dst))
