"""ComfyUI's model merge nodes with CUDA graphs, in process on the current ComfyUI (`comfy_env`'s small SD1.5
checkpoint, 256 px, euler, 6 steps). model2 is a second UNet of the same layout with other weights (dev/fixtures.py's
UNet-only file, UNETLoader). A merge adds model2's tensors to a clone of the checkpoint's model as weight patches,
applied when the merged clone loads: every weight of the UNet changes while the module objects stay the same.

Per merge node: stock KSampler, then the Accelerated KSampler twice, both within fp16 noise of stock, the second
prompt replaying graphs with no new capture. Then ratios 0.6 -> 0.3 -> 0.6, the plain checkpoint, and a LoRA on
the merge, one after another on the same modules: each equals stock for its own weights, never a graph captured on
another's (tests/server/test_model_merge.py checks the same graphs on the CPU, both ComfyUIs)."""
import importlib
import os

import pytest
import torch

from test_graphs_gpu import COMFY, WORK, _rel, _sample, comfy_env  # noqa: F401  (the shared module fixture)

TOL = 2e-2
# a merge must move stock's latent by more than this, or a lost merge could pass within TOL
MIN_EFFECT = TOL + 1e-2
MERGES = {
    "ModelMergeSimple": ("nodes_model_merging", {"ratio": 0.6}),
    "ModelMergeBlocks": ("nodes_model_merging", {"input": 0.2, "middle": 0.7, "out": 0.5}),
    "ModelMergeSubtract": ("nodes_model_merging", {"multiplier": 0.3}),
    "ModelMergeSD1": ("nodes_model_merging_model_specific", {}),
}


@pytest.fixture(scope="module")
def second_unet(comfy_env):  # noqa: F811
    import folder_paths
    import fixtures
    folder = os.path.join(WORK, "diffusion_models")
    path = os.path.join(folder, "gpu_small_unet_seed7.safetensors")
    fixtures.ensure(path, fixtures.build_unet, COMFY, "small", path, 4, 7)
    folder_paths.add_model_folder_path("diffusion_models", folder, is_default=True)
    with torch.inference_mode():
        return comfy_env.nodes.UNETLoader().load_unet("gpu_small_unet_seed7.safetensors", "default")[0]


def _merge(env, model2, node, **inputs):
    module, defaults = MERGES[node]
    cls = importlib.import_module("comfy_extras." + module).NODE_CLASS_MAPPINGS[node]
    if node == "ModelMergeSD1":   # every block at its default (1.0: model1) but a few
        names = [n for n, spec in cls.INPUT_TYPES()["required"].items() if spec[0] == "FLOAT"]
        defaults = dict({n: 1.0 for n in names}, **{"input_blocks.1.": 0.3, "middle_block.1.": 0.0, "out.": 0.5})
    with torch.inference_mode():
        return getattr(cls(), cls.FUNCTION)(model1=env.model, model2=model2, **dict(defaults, **inputs))[0]


def _stock(env, model):
    out, _ = _sample(env, model, ours=False)
    assert torch.isfinite(out).all()
    return out


@pytest.mark.parametrize("node", list(MERGES))
def test_merged_model_equals_stock_and_reuses_its_graphs(comfy_env, second_unet, node):  # noqa: F811
    plain = _stock(comfy_env, comfy_env.model)
    merged = _merge(comfy_env, second_unet, node)
    ref = _stock(comfy_env, merged)
    assert _rel(ref, plain) > MIN_EFFECT, (node, "the merge moves the image too little to test", _rel(ref, plain))
    first, rep1 = _sample(comfy_env, merged)
    second, rep2 = _sample(comfy_env, merged)
    assert max(_rel(first, ref), _rel(second, ref)) < TOL, (node, _rel(first, ref), _rel(second, ref), rep2["graphs"])
    assert rep1["graphs"]["replays"] >= 1, rep1["graphs"]
    g = rep2["graphs"]
    assert g["replays"] >= 1 and g["captures"] == 0 and not g.get("refused"), g


def test_ratios_plain_and_lora_in_turn_never_replay_another_weights_graph(comfy_env, second_unet):  # noqa: F811
    """Each model of the sequence loads its own weights into the same modules; a replay of a graph keyed on
    another model's weights would give that model's latent."""
    with torch.inference_mode():
        lora = comfy_env.nodes.LoraLoader().load_lora(
            _merge(comfy_env, second_unet, "ModelMergeSimple"), comfy_env.clip, "gpu_small_lora.safetensors", 1.0,
            0.0)[0]
    models = {"0.6": _merge(comfy_env, second_unet, "ModelMergeSimple", ratio=0.6),
              "0.3": _merge(comfy_env, second_unet, "ModelMergeSimple", ratio=0.3),
              "plain": comfy_env.model, "0.6+lora": lora}
    refs = {name: _stock(comfy_env, m) for name, m in models.items()}
    for a in refs:
        for b in refs:
            if a < b:
                assert _rel(refs[a], refs[b]) > MIN_EFFECT, (a, b, _rel(refs[a], refs[b]))
    for name in ("0.6", "0.6", "0.3", "0.6", "plain", "0.3", "0.6+lora", "0.6", "0.6+lora"):
        out, rep = _sample(comfy_env, models[name])
        assert _rel(out, refs[name]) < TOL, (name, _rel(out, refs[name]), rep["graphs"])
        assert not rep["graphs"].get("refused"), (name, rep["graphs"])
