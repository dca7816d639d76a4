"""GPU only: ComfyUI's hooks (comfy_extras/nodes_hooks.py) under the Accelerated KSampler, in-process on the current
ComfyUI (the `comfy_env` of test_graphs_gpu.py: the small random SD1.5 checkpoint, 256 px, euler, 6 steps).

A hook LoRA set on the positive conditioning only (Create Hook LoRA + Cond Pair Set Props) makes ComfyUI run the
positive and negative rows as separate UNet calls and patch the UNet's weights in place between them (and, with
keyframes, change the LoRA's strength during the run). The Accelerated KSampler's latent equals stock KSampler's
with the same hooks (fp16 noise), on the first prompt and on the second, where the graphs replay (a graph reads
the weights where ComfyUI patched them in place, so one graph per row kind serves every strength); the hooks
move stock's latent (so a lost hook fails); the plain graph afterwards gives the plain latent again."""
import pytest

from test_graphs_gpu import _rel, comfy_env  # noqa: F401  (the shared module fixture)

LORA = "gpu_small_lora.safetensors"   # test_graphs_gpu's UNet LoRA
TOL = 2e-2
MIN_EFFECT = TOL + 1e-2
SIZE, STEPS = 256, 6


def _conds(env, keyframes):
    import comfy_extras.nodes_hooks as nh
    hooks = nh.CreateHookLora().create_hook(LORA, 1.0, 0.0)[0]
    if keyframes:
        kf = nh.CreateHookKeyframesInterpolated().create_hook_keyframes(0.0, 1.5, "linear", 0.0, 1.0, 4)[0]
        hooks = nh.SetHookKeyframes().set_hook_keyframes(hooks, kf)[0]
    # the hook on the positive rows only: the negative ones run as a call of their own, without it
    pos = nh.PairConditioningSetProperties().set_properties(env.pos, env.pos, 1.0, "default", hooks=hooks)[0]
    return pos, env.neg


def _sample(env, pos, neg, ours, model=None):
    import torch
    model = model or env.model
    with torch.inference_mode():
        lat = env.nodes.EmptyLatentImage().generate(SIZE, SIZE, 1)[0]
        if ours:
            res = env.ours.sample(model, 5, STEPS, 7.0, "euler", "normal", pos, neg, lat)
            return res["result"][0]["samples"].float(), res["ui"]["sdaccel_report"][0]
        out = env.nodes.KSampler().sample(model, 5, STEPS, 7.0, "euler", "normal", pos, neg, lat)[0]
        return out["samples"].float(), None


@pytest.mark.parametrize("keyframes", [False, True], ids=["hook_lora", "hook_lora_keyframes"])
def test_a_hook_lora_on_the_positive_rows_equals_stock(comfy_env, keyframes):  # noqa: F811
    env = comfy_env
    plain, _ = _sample(env, env.pos, env.neg, ours=False)
    pos, neg = _conds(env, keyframes)
    ref, _ = _sample(env, pos, neg, ours=False)
    assert _rel(ref, plain) > MIN_EFFECT, "the hook did not move stock's latent"
    reports = []
    for _ in range(2):   # the second prompt replays what the first captured
        out, report = _sample(env, pos, neg, ours=True)
        assert _rel(out, ref) < TOL, (_rel(out, ref), report["line"])
        reports.append(report)
    again, _ = _sample(env, env.pos, env.neg, ours=True)
    assert _rel(again, plain) < TOL, "the hook's weights stayed on the model after its run"
    assert reports[-1]["graphs"]["replays"] >= STEPS, reports[-1]["graphs"]


def test_a_hook_lora_on_an_fp8_stored_unet_equals_stock(comfy_env, monkeypatch):  # noqa: F811
    """The fp8-stored UNet runs on upcast fp16 copies of its weights (engine/fp8/upcast.py), which a hook's in-place
    patch does not reach: with hooks, the copies are made again for every call. Without that rule (patched out
    at the end) ours gives the unhooked weights' result on the hooked rows: the test shows the rule is needed."""
    import os
    import folder_paths
    import patch_nodes
    from sd_accel.hosts.comfyui import accelerate
    from test_graphs_gpu import WORK
    folder_paths.add_model_folder_path("diffusion_models", os.path.join(WORK, "checkpoints"), is_default=True)
    env = comfy_env
    model = patch_nodes.load_fp8_unet("gpu_small.safetensors")
    plain, _ = _sample(env, env.pos, env.neg, ours=False, model=model)
    pos, neg = _conds(env, keyframes=False)
    ref, _ = _sample(env, pos, neg, ours=False, model=model)
    assert _rel(ref, plain) > MIN_EFFECT, "the hook did not move stock's latent"
    for _ in range(2):
        out, report = _sample(env, pos, neg, ours=True, model=model)
        assert any("upcast" in n for n in report["notes"]), report["line"]   # the copies were made and used
        assert _rel(out, ref) < TOL, (_rel(out, ref), report["line"])
    again, _ = _sample(env, env.pos, env.neg, ours=True, model=model)
    assert _rel(again, plain) < TOL, "the hook's weights stayed on the model after its run"
    monkeypatch.setattr(accelerate, "hooks_patch_weights", lambda base_model: False)
    stale, _ = _sample(env, pos, neg, ours=True, model=model)
    assert _rel(stale, ref) > TOL, "without the rule the copies followed the hook anyway: the rule is not needed"
