"""nodes/vae_nodes.py in-process on ComfyUI's own VAE object (a tiny comfy.sd.VAE, CPU): the nodes' declarations,
VAE Decode / VAE Encode (SD Accel) giving VAE Decode's and VAE Encode's outputs with their report, and Apply SD
Accel (VAE) handing stock VAE Decode a copy that runs the fused kernels (interpreted, forced) within fp32 noise
while the input VAE stays stock."""
import importlib
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from sd_accel.engine.graphs import eager
from sd_accel.engine.reports import kernel_report
from sd_accel.nodes import vae_nodes

import comfy_inproc


@pytest.fixture(scope="module")
def vae():
    return comfy_inproc.tiny_vae(seed=6)


@pytest.fixture(autouse=True)
def _unload():
    yield
    mm = sys.modules.get("comfy.model_management")
    if mm is not None:
        mm.unload_all_models()


def _comfy_nodes():
    return importlib.import_module("nodes")


def _latent():
    return {"samples": torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(9))}


def _pixels():
    return torch.rand(1, 16, 16, 4, generator=torch.Generator().manual_seed(8))   # an alpha channel too


def test_nodes_declare_categories_descriptions_and_a_tooltip_on_every_input():
    from sd_accel.nodes import LOAD_ERRORS, NODE_CLASS_MAPPINGS
    assert "vae_nodes" not in LOAD_ERRORS
    expected = {"SDAccelVAEDecode": ("SD Accel/vae", ("IMAGE",)), "SDAccelVAEEncode": ("SD Accel/vae", ("LATENT",)),
                "SDAccelApplyVAE": ("SD Accel/patches", ("VAE",))}
    for node_id, (category, returns) in expected.items():
        cls = NODE_CLASS_MAPPINGS[node_id]
        assert cls.CATEGORY == category and cls.RETURN_TYPES == returns and len(cls.DESCRIPTION) > 80
        spec = cls.INPUT_TYPES()
        for group in spec.values():
            assert all(conf[1].get("tooltip") for conf in group.values()), node_id
    assert set(vae_nodes.SDAccelVAEDecode.INPUT_TYPES()["optional"]) == {"release_cache", "fused_kernels",
                                                                         "cuda_graph", "channels_last"}


def test_decode_and_encode_give_vae_decode_s_and_vae_encode_s_outputs_and_say_what_ran(vae):
    with torch.inference_mode():
        ref_img = _comfy_nodes().VAEDecode().decode(vae, _latent())[0]
        torch.manual_seed(0)   # ComfyUI 2024 samples the latent from the global generator
        ref_lat = _comfy_nodes().VAEEncode().encode(vae, _pixels())[0]["samples"]
        dec = vae_nodes.SDAccelVAEDecode().decode(_latent(), vae, 0.0)
        torch.manual_seed(0)
        enc = vae_nodes.SDAccelVAEEncode().encode(_pixels(), vae)
    assert torch.equal(dec["result"][0], ref_img) and torch.equal(enc["result"][0]["samples"], ref_lat)
    for out in (dec, enc):
        (line,) = out["ui"]["text"]
        assert "ran: stock modules only" in line and "VAE on cpu" in line, line
    assert enc["ui"]["sdaccel_vae"][0]["memory"]["stages"][0]["stage"] == "VAE encode"


def test_apply_hands_stock_vae_decode_a_copy_that_runs_the_fused_kernels(vae, monkeypatch):
    (line,) = vae_nodes.SDAccelApplyVAE().apply(vae)["ui"]["text"]
    assert "patched: nothing" in line and "VAE on cpu" in line
    monkeypatch.setattr(eager, "FORCED_PATH", "fused")
    out = vae_nodes.SDAccelApplyVAE().apply(vae, fused_kernels=True, cuda_graph=True, channels_last=True)
    (acc,) = out["result"]
    (line,) = out["ui"]["text"]
    assert acc is not vae and line.startswith("patched: group_norm x4, vae_resnet_block x10 | "), line
    fp32 = "fell back: channels_last: a float32 VAE keeps stock's layout"   # the CPU's VAE is fp32
    import comfy.model_patcher as mp
    if hasattr(mp.ModelPatcher, "add_callback_with_key"):
        assert "| decode, encode: a CUDA graph per shape | " + fp32 in line, line
    else:
        assert "| " + fp32 in line and "; cuda_graph: this ComfyUI has no ON_DETACH" in line, line
    k0 = kernel_report.snapshot()
    with torch.inference_mode():
        img = _comfy_nodes().VAEDecode().decode(acc, _latent())[0]
        calls = kernel_report.summarize(k0, kernel_report.snapshot())
        ref = _comfy_nodes().VAEDecode().decode(vae, _latent())[0]
    assert calls["vae_norm_silu"]["fused"] == 6 and torch.allclose(img, ref, atol=1e-4)
    assert not vae.patcher.object_patches
