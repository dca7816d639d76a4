"""The VAE plan (engine/patches/fused_vae.py) on ComfyUI's own VAE classes (a tiny AutoencoderKL, random weights):
what it stands in for, that the stand-ins keep the host's classes and tensors, that the fused path (kernels under
the Triton interpreter) matches the host's modules within fp32 noise, and that the host's forward runs, bit for
bit, wherever the stand-in cannot compute a call."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from sd_accel.engine.patches import fused_modules as fm
from sd_accel.engine.patches import fused_vae, patching, stock_path
from sd_accel.engine.reports import kernel_report

import comfy_inproc


@pytest.fixture(scope="module")
def model():
    return comfy_inproc.tiny_autoencoder(seed=3)


def _inputs():
    g = torch.Generator().manual_seed(11)
    return torch.randn(1, 4, 8, 8, generator=g), torch.rand(1, 3, 16, 16, generator=g) * 2 - 1


def _resnet_names(root):
    return {n for n, m in root.named_modules() if type(m).__name__ == "ResnetBlock"}


def _close(a, b):
    return torch.allclose(a, b, atol=2e-5 * float(b.abs().max()), rtol=1e-4)


def test_plan_stands_in_for_every_resnet_block_and_fuses_the_other_group_norms(model):
    before = {n: m for n, m in model.named_modules()}
    plan = fused_vae.plan_vae(model, prefix="m.")
    blocks = {p[2:] for p, m in plan.patches.items() if fm.kind_of(m) == "vae_resnet"}
    norms = {p[2:] for p, m in plan.patches.items() if fm.kind_of(m) == "group_norm"}
    assert blocks == _resnet_names(model) and plan.counts["vae_resnet_block"] == len(blocks) == 10
    assert norms == {"encoder.mid.attn_1.norm", "encoder.norm_out", "decoder.mid.attn_1.norm", "decoder.norm_out"}
    assert plan.counts["group_norm"] == 4 and not any(n.startswith(b + ".") for n in norms for b in blocks)
    for path in blocks:
        new, orig = plan.patches["m." + path], model.get_submodule(path)
        assert type(new) is type(orig), "an instance of the host's own class"
        assert [(k, id(p)) for k, p in new.named_parameters()] == [(k, id(p)) for k, p in orig.named_parameters()]
    assert {n: m for n, m in model.named_modules()} == before, "planning never modifies the tree"
    assert not any("sdaccel_mixin" in m.__dict__ for m in model.modules())


def _coded(model, z, x):
    """(decode(z), encode(x)); ComfyUI 2024's encode samples the latent from the global generator: seeded alike."""
    out = model.decode(z)
    torch.manual_seed(0)
    return out, model.encode(x)


@pytest.fixture(scope="module")
def fused_run(model):
    """(stock outputs, fused outputs, kernel calls, stock outputs after restoring) of a decode and an encode."""
    z, x = _inputs()
    with torch.inference_mode():
        stock = _coded(model, z, x)
        backup = patching.apply_patches(model, fused_vae.plan_vae(model).patches)
        k0 = kernel_report.snapshot()
        try:
            fused = _coded(model, z, x)
            calls = kernel_report.summarize(k0, kernel_report.snapshot())
            with stock_path.stock_modules():
                in_stock_scope = _coded(model, z, x)
        finally:
            patching.restore(model, backup)
        after = _coded(model, z, x)
    return stock, fused, calls, in_stock_scope, after


def test_fused_decode_and_encode_match_the_host_modules_within_fp32_noise(fused_run):
    stock, fused, calls, _, after = fused_run
    for s, f in zip(stock, fused):
        assert _close(f, s), float((f - s).abs().max())
        assert not torch.equal(f, s), "the fused kernels ran (not the host's modules)"
    # decoder: 6 ResnetBlocks, encoder 4; each: norm1+SiLU, norm2+SiLU with conv1's bias, biases + residual
    for op in ("vae_norm_silu", "vae_add_norm_silu", "vae_bias_residual"):
        assert calls[op] == {"fused": 10, "fallback": 0, "reasons": []}, (op, calls.get(op))
    assert calls["group_norm"]["fused"] == 4
    assert all(torch.equal(a, s) for a, s in zip(after, stock)), "restored: the host's modules, bit for bit"


def test_inside_the_stock_scope_the_stand_ins_run_the_host_forward_bit_for_bit(fused_run):
    stock, _, _, in_stock_scope, _ = fused_run
    assert all(torch.equal(a, s) for a, s in zip(in_stock_scope, stock))


def _block(**kw):
    comfy_inproc.fixtures_module()
    from comfy.ldm.modules.diffusionmodules.model import ResnetBlock
    torch.manual_seed(5)
    b = ResnetBlock(dropout=0.0, **kw).eval()
    with torch.no_grad():
        for name, p in b.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.2 if p.dim() > 1 else 0.3) + (1 if "norm" in name and
                                                                                  name.endswith("weight") else 0))
    return b


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_a_3x3_conv_shortcut_block_fused_matches_the_host_and_keeps_the_layout(layout):
    b = _block(in_channels=32, out_channels=64, conv_shortcut=True, temb_channels=0)
    assert fused_vae.eligible(b)
    x = torch.randn(2, 32, 6, 6)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    new = fm.clone_as(fused_vae.FusedVAEResnetBlock, b)
    with torch.inference_mode():
        ref, out = b(x, None), new(x, None)   # ComfyUI 2024: temb has no default
    assert _close(out, ref) and out.is_contiguous(memory_format=torch.channels_last) == (layout == "channels_last")


def test_a_call_with_a_timestep_embedding_runs_the_host_forward_and_says_why():
    b = _block(in_channels=32, out_channels=32, temb_channels=8)
    new = fm.clone_as(fused_vae.FusedVAEResnetBlock, b)
    x, temb = torch.randn(1, 32, 4, 4), torch.randn(1, 8)
    k0 = kernel_report.snapshot()
    with torch.inference_mode():
        assert torch.equal(new(x, temb.clone()), b(x, temb.clone()))   # the host's SiLU on temb is in place
    calls = kernel_report.summarize(k0, kernel_report.snapshot())
    assert calls == {fused_vae.OP_BLOCK: {"fused": 0, "fallback": 1,
                                          "reasons": ["called with a timestep embedding or keywords"]}}


def test_blocks_whose_forward_or_layers_differ_from_the_host_s_are_not_planned():
    b = _block(in_channels=32, out_channels=32, temb_channels=0)
    base = type(b)
    other = type("ResnetBlock", (base,), {"forward": lambda self, x, temb=None: base.forward(self, x, temb) * 2})
    renamed = _block(in_channels=32, out_channels=32, temb_channels=0)
    renamed.__class__ = other
    assert fused_vae.eligible(b) and not fused_vae.eligible(renamed)
    b.conv1 = torch.nn.Sequential(b.conv1)
    assert not fused_vae.eligible(b), "a convolution the stand-in cannot call without its bias"
