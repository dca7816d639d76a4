"""A ControlNet under Accelerated KSampler with graphs off, in-process on a real ComfyUI (CPU): its calls take the
eager path the UNet's do (held to the stock one here, as a GPU's timing picks it where the host is the bound), the
report says so, the image is stock's bit for bit, and the cldm module's folded blocks (the patches folded into one per
top-level block) run their originals on that path."""
import pytest
import torch

import comfy_inproc


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cn_eager")
    return comfy_inproc.tiny_model_patcher(folder), comfy_inproc.tiny_controlnet(folder)


@pytest.fixture(autouse=True)
def stock_path(monkeypatch):
    from sd_accel.engine.graphs import eager
    monkeypatch.setattr(eager, "FORCED_PATH", "stock")
    yield
    import comfy.model_management as mm
    mm.unload_all_models()


def _conds(cn):
    hint = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    control = cn.copy().set_cond_hint(hint, 0.9)
    g = torch.Generator().manual_seed(11)
    return ([[torch.randn(1, 77, 768, generator=g), {"control": control}]],
            [[torch.randn(1, 77, 768, generator=g), {"control": control}]])


def _stock(model, pos, neg):
    import nodes
    with torch.inference_mode():
        return nodes.common_ksampler(model, 5, 3, 5.0, "euler", "normal", pos, neg,
                                     {"samples": torch.zeros(1, 4, 8, 8)})[0]["samples"]


def _ours(model, pos, neg):
    from sd_accel.nodes.sampler_nodes import SDAccelKSampler
    with torch.inference_mode():
        res = SDAccelKSampler().sample(model, 5, 3, 5.0, "euler", "normal", pos, neg,
                                       {"samples": torch.zeros(1, 4, 8, 8)}, cuda_graph=False)
    return res["result"][0]["samples"], res["ui"]["text"][0]


class _SequentialsCalled:
    """The TimestepEmbedSequential instances that run while inside (ComfyUI's blocks of both models)."""

    def __init__(self, monkeypatch):
        from comfy.ldm.modules.diffusionmodules import openaimodel
        self.ids = set()
        forward = openaimodel.TimestepEmbedSequential.forward

        def spy(module, *a, **k):
            self.ids.add(id(module))
            return forward(module, *a, **k)
        monkeypatch.setattr(openaimodel.TimestepEmbedSequential, "forward", spy)


def test_controlnet_without_graphs_runs_on_the_eager_path_with_the_originals_and_gives_stocks_image(env, monkeypatch):
    from comfy.ldm.modules.diffusionmodules import openaimodel
    from sd_accel.hosts.comfyui import controlnet as host_cn
    from sd_accel.hosts.comfyui import object_patches
    model, cn = env
    cldm = cn.control_model
    originals = {id(m) for m in cldm.input_blocks.modules() if isinstance(m, openaimodel.TimestepEmbedSequential)}
    assert originals
    pos, neg = _conds(cn)
    ref = _stock(model, pos, neg)

    seen = _SequentialsCalled(monkeypatch)
    # the plan the run will use, to know whether this ComfyUI folds the ControlNet's blocks
    planned, _ = host_cn.plan_controlnet(cn.control_model_wrapped.clone(), host_cn.ControlNetOptions())
    folds = "input_blocks" in planned and object_patches.is_folded(planned["input_blocks"])
    assert folds, "the ControlNet's patches are folded into one per top-level block on both ComfyUIs"
    ours, line = _ours(model, pos, neg)

    assert "controlnet: 1 patched" in line, line
    assert "calls on the stock modules" in line.split("controlnet:")[1], line
    assert torch.equal(ours, ref), "the stock path computes stock's image"
    copies = {id(m) for m in planned["input_blocks"].modules()} - originals
    ran = seen.ids & (copies | originals)
    assert ran and ran <= originals, "the ControlNet's folded blocks ran their copies on the stock path"
