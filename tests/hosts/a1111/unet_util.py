"""Helpers for the A1111 tests: a reduced SD1.5-layout ldm `UNetModel` (the class A1111 runs, from
PyPI's stable-diffusion-sdkit), an A1111-shaped model around it (`sd_model.model.diffusion_model`),
and `load_extension_script` (scripts/sd_accel.py loaded the way A1111 loads it)."""
import importlib.util
import os
import sys
import types

import torch
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# one level, one ResBlock + SpatialTransformer per block: every op SD Accel fuses, small enough for
# Triton's CPU interpreter (about 0.5 s per GroupNorm call there)
UNET_CONFIG = dict(image_size=4, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=1,
                   attention_resolutions=[1], channel_mult=[1], num_heads=2, use_spatial_transformer=True,
                   transformer_depth=1, context_dim=32, use_checkpoint=False, legacy=False)


def make_unet(seed=0):
    from ldm.modules.diffusionmodules.openaimodel import UNetModel
    torch.manual_seed(seed)
    unet = UNetModel(**UNET_CONFIG).eval()
    with torch.no_grad():   # ldm zero-inits output convs; random values make every block matter
        for name, p in unet.named_parameters():
            if p.dim() == 1 and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.05 * torch.randn_like(p))
            elif p.abs().sum() == 0:
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)
    return unet


def unet_inputs(seed=1, batch=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, 4, 4, generator=g)
    t = torch.tensor([500, 20][:batch])
    ctx = torch.randn(batch, 5, UNET_CONFIG["context_dim"], generator=g)
    return x, t, ctx


class _Wrapper(nn.Module):
    """ldm's DiffusionWrapper: `model.diffusion_model`."""

    def __init__(self, unet):
        super().__init__()
        self.diffusion_model = unet


class FakeSdModel(nn.Module):
    """The shape of A1111's LatentDiffusion that the extension reads."""

    def __init__(self, unet, model_name="ci_small"):
        super().__init__()
        self.model = _Wrapper(unet)
        self.sd_checkpoint_info = types.SimpleNamespace(model_name=model_name)
        self.lowvram = False

    @property
    def device(self):
        return next(self.parameters()).device


def load_extension_script():
    """scripts/sd_accel.py as A1111 loads it (modules.script_loading.load_module)."""
    path = os.path.join(REPO, "scripts", "sd_accel.py")
    saved = sys.path
    sys.path = [REPO] + sys.path
    try:
        spec = importlib.util.spec_from_file_location(os.path.basename(path), path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path = saved
    return module
