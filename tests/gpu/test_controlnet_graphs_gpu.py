"""GPU only (run on the GPU machine with tests/gpu): a ControlNet run inside the UNet's CUDA graph (one
replay per step) never replays stale. Same process and models as test_graphs_gpu.py (its `comfy_env`
fixture, the small random SD1.5 checkpoint) plus a random ControlNet of the same preset. Each accelerated
image is compared with stock's for the same inputs: a new hint image, a new strength, and start/end percent
that leave some steps without the ControlNet, each on a later prompt whose graphs already exist."""
import os
import re

import pytest
import torch

from test_graphs_gpu import WORK, _rel, comfy_env  # noqa: F401  (the shared module fixture)


@pytest.fixture(scope="module")
def cn(comfy_env):  # noqa: F811
    import fixtures
    import folder_paths
    from test_graphs_gpu import COMFY
    os.makedirs(os.path.join(WORK, "controlnet"), exist_ok=True)
    folder_paths.add_model_folder_path("controlnet", os.path.join(WORK, "controlnet"), is_default=True)
    path = os.path.join(WORK, "controlnet", "gpu_small_cn.safetensors")
    fixtures.ensure(path, fixtures.build_controlnet, COMFY, "small", path, 6)
    with torch.inference_mode():
        return comfy_env.nodes.ControlNetLoader().load_controlnet("gpu_small_cn.safetensors")[0]


def _hint(seed, size=256):
    g = torch.Generator().manual_seed(seed)
    return torch.rand((1, size, size, 3), generator=g)


def _sample(env, cn, hint, strength=1.0, start=0.0, end=1.0, ours=True, model=None):
    model = env.model if model is None else model
    with torch.inference_mode():
        pos, neg = env.nodes.ControlNetApplyAdvanced().apply_controlnet(env.pos, env.neg, cn, hint, strength,
                                                                      start, end)[:2]
        lat = env.nodes.EmptyLatentImage().generate(256, 256, 1)[0]
        if ours:
            res = env.ours.sample(model, 9, 6, 7.0, "euler", "normal", pos, neg, lat)
            return res["result"][0]["samples"].float(), res["result"][1]
        return env.nodes.KSampler().sample(model, 9, 6, 7.0, "euler", "normal", pos, neg, lat)[0]["samples"].float(), None


def test_controlnet_graphs_follow_hint_strength_and_range(comfy_env, cn):  # noqa: F811
    # hints far apart (a dark and a bright random image): a random ControlNet moves the image only a little,
    # so each change is checked against the change it makes in stock's image, not against a fixed size
    cases = [dict(hint=_hint(1) * 0.2), dict(hint=_hint(1) * 0.2), dict(hint=1.0 - _hint(2) * 0.2),
             dict(hint=1.0 - _hint(2) * 0.2, strength=0.4), dict(hint=1.0 - _hint(2) * 0.2, strength=0.4,
                                                                  start=0.3, end=0.7)]
    outs, refs = [], []
    for i, case in enumerate(cases):
        ref, _ = _sample(comfy_env, cn, ours=False, **case)
        out, line = _sample(comfy_env, cn, **case)
        assert _rel(out, ref) < 2e-2, (i, case.keys(), _rel(out, ref), line)
        # the ControlNet ran inside the UNet's graph on every step (one replay per step), never on its own
        assert "controlnet: 1 patched" in line and "in the UNet's graph: 6 calls" in line, line
        assert "own graphs" not in line, line
        # nor did it warm up or capture graphs of its own (they would only hold memory): its own counters
        # show no replay and no capture, also on prompts where the UNet's graph is new (a new strength, range)
        own = re.search(r"graphs: (\d+) replays, (\d+) captures", line.split(" | ")[-1])
        assert own is None or own.groups() == ("0", "0"), line
        outs.append(out)
        refs.append(ref)
        if i in (1, 2):   # same ControlNet, strength and range (a new hint is an input): replayed, no capture
            assert re.search(r"cuda_graph \(6 replays, 0 captures\)", line), line
    for i, what in ((2, "a new hint"), (3, "a new strength"), (4, "start/end percent")):
        d_ref = _rel(refs[i], refs[i - 1])
        d_out = _rel(outs[i], outs[i - 1])
        # a stale graph replays the previous prompt's ControlNet: ours would not move at all (a replay with the
        # same inputs is bit-exact). The direction of the change is not compared: ours and stock differ by fp16
        # noise of the same order as these small changes (run 18: 1.3 relative between the two differences)
        assert d_ref > 1e-4, (what, "changes stock's image too little to test", d_ref)
        assert 0.5 * d_ref < d_out < 2.0 * d_ref, (what, "changed ours by", d_out, "stock by", d_ref)


def test_a_controlnet_layout_change_between_runs_never_replays_stale(comfy_env, cn):  # noqa: F811
    """The ControlNet's conv weights change layout between our runs: its own graphs (a run where another pack's
    apply_model wrapper sits outside ours, so the chain cannot join the UNet's graph) convert them to
    channels_last, and ComfyUI's detach for a stock KSampler with the same ControlNet puts them back. A UNet
    graph captured over one layout must never replay over the other: each of our images equals stock's."""
    import comfy.patcher_extension as pe
    env = comfy_env
    hint = _hint(3) * 0.5
    theirs = env.model.clone()
    theirs.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, "another_pack",
                                lambda executor, *args, **kwargs: executor(*args, **kwargs))

    ref, _ = _sample(env, cn, hint, ours=False)
    _, line = _sample(env, cn, hint, model=theirs)
    # the ControlNet's own graphs (not in the UNet's: another wrapper is outside ours), captured over
    # channels_last weights (converted before their capture)
    cn_part = line.split(" | ")[-1]
    assert "in the UNet's graph" not in cn_part and re.search(r"graphs: \d+ replays, [1-9]\d* captures",
                                                              cn_part), line
    out, line = _sample(env, cn, hint)         # the UNet's graph, captured with the ControlNet in it
    assert "in the UNet's graph: 6 calls" in line, line
    assert _rel(out, ref) < 2e-2, (_rel(out, ref), line)
    again_ref, _ = _sample(env, cn, hint, ours=False)   # ComfyUI detaches our copy: stock's layout back
    out, line = _sample(env, cn, hint)
    assert "in the UNet's graph: 6 calls" in line, line
    assert _rel(out, again_ref) < 2e-2, (_rel(out, again_ref), line)
    assert _rel(out, ref) < 2e-2


def test_a_union_controlnets_type_switch_between_prompts_never_replays_stale(comfy_env):  # noqa: F811
    """ControlNet Union (ControlNet++): the control type SetUnionControlNetType sets becomes a one-hot embedding and
    a task-embedding row inside the ControlNet's forward, which a graph bakes in. Prompts depth, canny, depth with the
    same hint: each is stock's image; the switch to canny moves ours as it moves stock's (a stale replay of depth's
    graph would not move it at all); the third prompt replays depth's graph from the first."""
    import fixtures
    from comfy_extras.nodes_controlnet import SetUnionControlNetType
    from test_graphs_gpu import COMFY
    union = fixtures.union_controlnet(COMFY, "small", seed=8, dtype="float16")
    if union is None:
        pytest.skip("this ComfyUI has no ControlNet Union")
    hint = _hint(3)
    outs, refs = [], []
    for i, type_name in enumerate(("depth", "canny/lineart/anime_lineart/mlsd", "depth")):
        typed = SetUnionControlNetType().set_controlnet_type(union, type_name)[0]
        ref, _ = _sample(comfy_env, typed, hint, ours=False)
        out, line = _sample(comfy_env, typed, hint)
        assert _rel(out, ref) < 2e-2, (type_name, _rel(out, ref), line)
        assert "in the UNet's graph: 6 calls" in line, line
        if i == 2:
            assert re.search(r"cuda_graph \(6 replays, 0 captures\)", line), line
        outs.append(out)
        refs.append(ref)
    d_ref, d_out = _rel(refs[1], refs[0]), _rel(outs[1], outs[0])
    assert d_ref > 1e-4, ("the type changes stock's image too little to test", d_ref)
    assert 0.5 * d_ref < d_out < 2.0 * d_ref, ("the type switch changed ours by", d_out, "stock by", d_ref)
