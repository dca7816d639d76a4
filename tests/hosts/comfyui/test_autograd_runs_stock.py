"""Under autograd (ComfyUI's Train LoRA node turns inference mode off around its steps) an accelerated model runs the
stock modules: the fused kernels compute forward only and a graph's replay records no gradient, so anything else would
train on other numbers than stock's, or on none. In-process on a real ComfyUI (CPU, the kernels interpreted: without
autograd they run and round otherwise than stock's ops): the trained LoRA is stock's bit for bit."""
import pytest
import torch

import comfy_inproc


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return comfy_inproc.tiny_model_patcher(tmp_path_factory.mktemp("autograd"))


@pytest.fixture(autouse=True)
def unload():
    yield
    import comfy.model_management as mm
    mm.unload_all_models()


def test_train_lora_on_an_apply_sd_accel_model_trains_as_stock(model):
    """ComfyUI's Train LoRA node on Apply SD Accel's output: the same losses and the same trained LoRA, bit for bit,
    as on the model itself."""
    try:
        from comfy_extras.nodes_train import TrainLoraNode
    except ImportError:
        pytest.skip("this ComfyUI (2024) has no Train LoRA node")
    import comfy.model_management as mm
    from sd_accel.nodes.sampler_nodes import SDAccelApply
    g = torch.Generator().manual_seed(11)
    cond = [[torch.randn(1, 77, 768, generator=g), {}]]
    latents = {"samples": torch.randn(2, 4, 8, 8, generator=g)}

    def train(m):
        torch.manual_seed(0)   # the LoRA's initial weights come from torch's global generator
        out = TrainLoraNode().train(m, latents, cond, 1, 3, 1, 1e-3, 4, "AdamW", "MSE", 0, "bf16", "bf16", "LoRA",
                                    False, "[None]")
        mm.unload_all_models()
        return out[1], out[2]["loss"]
    ref, ref_loss = train(model)
    with torch.inference_mode():
        accelerated = SDAccelApply().apply(model)["result"][0]
    got, loss = train(accelerated)
    assert loss == ref_loss
    assert ref.keys() == got.keys() and ref
    assert all(torch.equal(got[k], ref[k]) for k in ref), max(float((got[k] - ref[k]).abs().max()) for k in ref)
