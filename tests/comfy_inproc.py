"""ComfyUI imported in the test process (CPU), for tests that need its real classes.

Which ComfyUI: $SDACCEL_COMFYUI, else the 2024 copy dev/setup_env.sh installs. Shared by the engine
tests so the import order (args.cpu before comfy.model_management) lives in one place.
"""
import importlib.util
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOME = os.environ.get("SDACCEL_HOME", os.path.expanduser("~/.cache/sd_accel"))
COMFY = os.environ.get("SDACCEL_COMFYUI") or os.path.join(HOME, "ComfyUI-2024")


def fixtures_module():
    """dev/fixtures.py, with ComfyUI importable (fails the test clearly when ComfyUI is missing)."""
    if not os.path.isfile(os.path.join(COMFY, "main.py")):
        pytest.fail("no ComfyUI at %s: run dev/setup_env.sh (or set SDACCEL_COMFYUI)" % COMFY)
    if os.path.join(REPO, "dev") not in sys.path:
        sys.path.insert(0, os.path.join(REPO, "dev"))
    import fixtures
    fixtures._import_comfy(COMFY)
    return fixtures


def comfy_nodes():
    """ComfyUI's own nodes.py, loaded as main.py has it before any custom node. By name alone `import nodes` can
    find this repo's nodes/ package first (pytest puts the repo root on sys.path, at times ahead of ComfyUI)."""
    fixtures_module()
    mod = sys.modules.get("nodes")
    if mod is None or os.path.dirname(os.path.abspath(getattr(mod, "__file__", "") or "")) != os.path.abspath(COMFY):
        spec = importlib.util.spec_from_file_location("nodes", os.path.join(COMFY, "nodes.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["nodes"] = mod
        spec.loader.exec_module(mod)
    return mod


def tiny_unet(seed=0, operations=None, std=None):
    """ComfyUI's real openaimodel.UNetModel at the reduced 'tiny' SD1.5 preset, random weights."""
    fixtures = fixtures_module()
    import comfy.ops
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    cfg = fixtures.sd15_unet_config("tiny")
    for k in ("use_temporal_attention", "use_temporal_resblock"):
        cfg.pop(k)
    torch.manual_seed(seed)
    unet = UNetModel(**cfg, dtype=torch.float32, operations=operations or comfy.ops.disable_weight_init)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in unet.named_parameters():
            scale = std if std is not None else (0.05 if p.dim() > 1 else 0.5)
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1 if name.endswith("norm.weight") else 0))
    return unet.eval()


def unet_inputs(unet, seed=1):
    """(x, timesteps, context) for a CFG batch of 2 through a tiny UNet, the context width its cross-attention's."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 8, 8, generator=g)
    t = torch.tensor([500.0, 20.0])
    ctx = torch.randn(2, 7, unet.input_blocks[1][1].transformer_blocks[0].attn2.to_k.in_features, generator=g)
    return x, t, ctx


_BUILT = {}   # (preset, seed) -> the checkpoint's path, built once per test process


def _checkpoint(folder, seed, preset):
    fixtures = fixtures_module()
    path = _BUILT.get((preset, seed))
    if path is None or not os.path.isfile(path):
        path = os.path.join(str(folder), "%s_%d.safetensors" % (preset, seed))
        fixtures.build_checkpoint(COMFY, "sd15", preset, path, seed=seed)
        _BUILT[(preset, seed)] = path
    return path


def tiny_clip(folder, seed=5, preset="tiny"):
    """A real comfy.sd.CLIP: the full-size CLIP-L text encoder of `tiny_model_patcher`'s checkpoint, as ComfyUI's
    own loader builds it (its tokenizer, its ModelPatcher), a new one per call."""
    path = _checkpoint(folder, seed, preset)
    import comfy.sd
    with torch.inference_mode():
        return comfy.sd.load_checkpoint_guess_config(path, output_vae=False, output_clip=True)[1]


def tiny_checkpoint(folder, seed=5, preset="tiny"):
    """The path of `tiny_model_patcher`'s checkpoint file (written once per (preset, seed) and process), with
    ComfyUI importable, for a test that loads it its own way."""
    return _checkpoint(folder, seed, preset)


def tiny_model_patcher(folder, seed=5, preset="tiny"):
    """A real ComfyUI ModelPatcher: a random SD1.5 checkpoint at a reduced preset (dev/fixtures.py) loaded by
    ComfyUI's own load_checkpoint_guess_config (UNet only), a new one per call. The file is written once per
    (preset, seed) and process, into the first caller's `folder`: with its full-size text encoder it is ~450 MB,
    and one per test filled gigabytes of pytest's temporary folders."""
    path = _checkpoint(folder, seed, preset)
    import comfy.sd
    with torch.inference_mode():
        return comfy.sd.load_checkpoint_guess_config(path, output_vae=False, output_clip=False)[0]


def tiny_controlnet(folder, seed=3, preset="tiny"):
    """A random ControlNet of `tiny_model_patcher`'s layout (dev/fixtures.py), written into `folder` and loaded by
    ComfyUI's own load_controlnet."""
    fixtures = fixtures_module()
    import comfy.controlnet
    path = os.path.join(str(folder), "cn_%s_%d.safetensors" % (preset, seed))
    fixtures.build_controlnet(COMFY, preset, path, seed=seed)
    return comfy.controlnet.load_controlnet(path)


def sample_tiny(model, steps=1, cfg=1.0, batch=1):
    """ComfyUI's own common_ksampler (seed 3, euler, normal) on `model` over a zero latent [batch, 4, 8, 8], with
    random 768-wide cond and uncond (seeded): the latent, for tests that compare a sampling run with stock's."""
    import nodes
    g = torch.Generator().manual_seed(11)
    cond = [[torch.randn(1, 77, 768, generator=g), {}]]
    neg = [[torch.randn(1, 77, 768, generator=g), {}]]
    with torch.inference_mode():
        return nodes.common_ksampler(model, 3, steps, cfg, "euler", "normal", cond, neg,
                                     {"samples": torch.zeros(batch, 4, 8, 8)})[0]["samples"]


def coarse_upcast_tiles(monkeypatch):
    """The fp8 group upcast kernel with tiles 8x its default (a block size it takes; tests/kernels covers the default):
    interpreted on the CPU it costs per tile, and a tiny UNet's ~70 groups a step took minutes."""
    import functools
    from sd_accel.kernels import upcast_fp8
    from sd_accel.engine.fp8 import block_upcast
    monkeypatch.setattr(block_upcast.kernel, "Layout", functools.partial(upcast_fp8.Layout, block=8 * upcast_fp8.BLOCK))


class TaggedModule(torch.nn.Module):
    """Another pack's object patch, for tests: runs the module it replaces and counts its calls."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, *a, **k):
        self.calls += 1
        return self.inner(*a, **k)


TINY_VAE = {"double_z": True, "z_channels": 4, "resolution": 64, "in_channels": 3, "out_ch": 3, "ch": 32,
            "ch_mult": [1, 2], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0}


def tiny_autoencoder(seed=0):
    """ComfyUI's real AutoencoderKL (SD's VAE classes) at 32/64 channels, 2x down/up, seeded random weights (its
    ops leave them uninitialised): fan-in-scaled convs, norm scales near 1, small biases."""
    fixtures_module()
    from comfy.ldm.models.autoencoder import AutoencoderKL
    model = AutoencoderKL(ddconfig=dict(TINY_VAE), embed_dim=4)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) / (p[0].numel() ** 0.5))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def tiny_vae(seed=0):
    """A real comfy.sd.VAE (its patcher, memory estimates, tiled decode) holding `tiny_autoencoder`'s weights,
    with its scale ratios set to the tiny model's 2x."""
    sd = tiny_autoencoder(seed).state_dict()
    import comfy.sd
    vae = comfy.sd.VAE(sd=sd, config={"params": {"ddconfig": dict(TINY_VAE), "embed_dim": 4}})
    vae.upscale_ratio = vae.downscale_ratio = 2
    return vae
