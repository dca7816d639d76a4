"""Helpers for the Forge tests: the stand-in of Forge's backend (fake_forge/, see its README) on sys.path,
the ldm UNet built the way Forge builds its UNet (`torch.nn` ops swapped for Forge's while constructing,
so GEGLU's `proj` is Forge's Linear), and a Forge-shaped SD model (`sd_model.forge_objects.unet`)."""
import os
import sys
import types

import torch

from unet_util import UNET_CONFIG, make_unet

FAKE_FORGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_forge")


def purge():
    for name in [n for n in sys.modules if n.split(".")[0] in ("backend", "modules_forge")]:
        del sys.modules[name]


def make_forge_unet(seed=0, manual_cast=False):
    from backend import operations
    with operations.using_forge_operations(manual_cast=manual_cast):
        return make_unet(seed)


def make_patcher(seed=0, manual_cast=False):
    from backend.k_model import KModel
    from backend.patcher import UnetPatcher
    return UnetPatcher(KModel(make_forge_unet(seed, manual_cast)).eval())


def make_controlnet(seed=5, hint_seed=6):
    """Forge's ControlNet (stand-in) of a control model built from its own random UNet, with a hint image."""
    from backend import cldm
    from backend.patcher.controlnet import ControlNet
    hint = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(hint_seed))
    return ControlNet(cldm.ControlModel(make_forge_unet(seed)).eval()).set_cond_hint(hint, 0.8)


def denoise(patcher, seed=1, lowvram=False):
    from backend import sampling
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 4, 4, generator=g)
    ctx = torch.randn(2, 5, UNET_CONFIG["context_dim"], generator=g)
    with torch.no_grad():
        return sampling.denoise(patcher, x, torch.tensor([2.0]), ctx, lowvram=lowvram)


def norm_and_geglu_lora(unet, scale=0.3, seed=3):
    """{model key: weight delta} for a LayerNorm, a GroupNorm and a GEGLU projection: the modules SD Accel
    replaces (a LoRA on those must reach the replacement and survive it)."""
    g = torch.Generator().manual_seed(seed)
    keys = [n for n, _ in unet.named_parameters()
            if n.endswith(("norm1.weight", "1.norm.weight", "in_layers.0.bias", "ff.net.0.proj.weight"))]
    return {"diffusion_model." + k: ("diff", (scale * torch.randn(unet.get_parameter(k).shape, generator=g),))
            for k in keys}


class ForgeSdModel:
    """The shape of Forge's SD model the extension reads: `forge_objects.unet`, no `.model`."""

    def __init__(self, patcher, model_name="ci_small"):
        self.forge_objects = types.SimpleNamespace(unet=patcher)
        self.sd_checkpoint_info = types.SimpleNamespace(model_name=model_name)
