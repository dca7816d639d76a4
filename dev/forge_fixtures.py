#!/usr/bin/env python3
"""Test files for dev/forge_check.py, made from an SD1.5 checkpoint (run with a Python that has torch and
safetensors: the Forge venv):

  lora  CKPT OUT   a LoRA on exactly the modules SD Accel replaces in Forge: LyCORIS norm deltas
                   (`.w_norm`/`.b_norm`) on every LayerNorm and GroupNorm of the UNet, and a low-rank pair
                   (`lora_up`/`lora_down`) on every GEGLU projection (`ff.net.0.proj`), named the kohya way
                   (`lora_unet_<path with _>`), which Forge's LoRA loader maps to the UNet's keys
  ckpt2 CKPT OUT   the same checkpoint with every UNet weight perturbed (a second checkpoint of the same
                   config, for the checkpoint switch)
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


if __name__ == "__main__":
    what, src, dst = sys.argv[1:4]
    n = make_lora(src, dst) if what == "lora" else make_second_checkpoint(src, dst)
    print("[fixtures] %s: %d tensors -> %s" % (what, n, dst))
