"""ControlNets deferred into the UNet's step (hosts/comfyui/control_graph.py), in-process on the CPU with
ComfyUI's real sampler (`comfy.sample.sample`), a tiny random SD1.5 checkpoint and tiny random ControlNets
chained the way ControlNetApplyAdvanced chains them. On the CPU no graph is captured, but the step runs
exactly what a capture records: the chain evaluated from the graph inputs, then the UNet. So the latent
must be stock's bit for bit, and the graph key must follow what a replay bakes in (strength, range, model)
and nothing that changes per prompt. The capture itself is tests/gpu/test_controlnet_graphs_gpu.py."""

import pytest
import torch

import comfy_inproc

STEPS = 4


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    fixtures = comfy_inproc.fixtures_module()
    import comfy.controlnet
    folder = tmp_path_factory.mktemp("cg")
    model = comfy_inproc.tiny_model_patcher(folder)
    cns = []
    for seed in (3, 4):   # two files: two separate ControlNet models, as a user's two ControlNets are
        path = str(folder / ("cn%d.safetensors" % seed))
        fixtures.build_controlnet(comfy_inproc.COMFY, "tiny", path, seed=seed)
        cns.append(comfy.controlnet.load_controlnet(path))
    return model, cns


@pytest.fixture(autouse=True)
def _unload():
    yield
    import comfy.model_management as mm
    mm.unload_all_models()


def _hint(seed):
    return torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(seed))


def _conds(cns, links):
    """positive/negative carrying one chain, as ControlNetApplyAdvanced builds it: a copy per link with
    its hint, strength and (start, end), each on top of the previous one; both conds share the chain."""
    prev = None
    for (i, hint, strength, rng) in links:
        prev = cns[i].copy().set_cond_hint(hint.movedim(-1, 1), strength, rng).set_previous_controlnet(prev)
    g = torch.Generator().manual_seed(11)
    return ([[torch.randn(1, 77, 768, generator=g), {"control": prev}]],
            [[torch.randn(1, 77, 768, generator=g), {"control": prev}]])


def _sample(patcher, pos, neg, seed=3):
    import comfy.sample
    latent = torch.zeros(1, 4, 8, 8)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        return comfy.sample.sample(patcher, noise, STEPS, 5.0, "euler", "normal", pos, neg, latent, seed=seed)


def _accelerated(model, pos, neg):
    from sd_accel.hosts.comfyui import accelerate as host
    from sd_accel.hosts.comfyui import controlnet as host_cn
    acc, info = host.accelerate(model, host.AccelOptions(fused_kernels=False, cuda_graph=True, channels_last=False))
    pos, neg, cn_info = host_cn.accelerate_conds(pos, neg, host_cn.ControlNetOptions(
        fused_kernels=False, hint_cache=False, cuda_graph=True, channels_last=False, one_graph=True))
    return acc, pos, neg, cn_info


def _spy_inputs(monkeypatch):
    """Records what every deferred step hands the graph (its inputs) and that the step evaluated it."""
    from sd_accel.hosts.comfyui import control_graph as cg
    seen = []
    evaluate = cg.DeferredControl.evaluate

    def spy(self, inputs, transformer_options=None):
        seen.append(inputs)
        return evaluate(self, inputs, transformer_options)
    monkeypatch.setattr(cg.DeferredControl, "evaluate", spy)
    return seen


@pytest.mark.parametrize("links", [
    [(0, 1, 0.8, (0.0, 1.0))],
    [(0, 1, 1.0, (0.0, 1.0)), (1, 2, 0.6, (0.3, 0.7))],   # the second link is off at some steps
], ids=["one", "chain_with_range"])
def test_deferred_chain_gives_stocks_latent(env, links, monkeypatch):
    model, cns = env
    spec = [(i, _hint(h), s, r) for i, h, s, r in links]
    ref = _sample(model, *_conds(cns, spec))
    seen = _spy_inputs(monkeypatch)
    acc, pos, neg, info = _accelerated(model, *_conds(cns, spec))
    out = _sample(acc, pos, neg)
    assert torch.equal(out, ref), float((out - ref).abs().max())
    assert info["one_graph"] == {"deferred": STEPS, "stock": {}}, info["one_graph"]
    assert len(seen) == STEPS, "every step ran the chain inside the UNet's step"
    described = [[d[0] for d in inp["links"]] for inp in seen]
    if len(links) == 2:
        # top of the chain first; the ranged link is described "off" on the steps outside its range
        assert ["off"] in [d[:1] for d in described] and all(d[1] == "ControlNet" for d in described)
        assert any(d[0] == "ControlNet" for d in described) and any(d[0] == "off" for d in described)
    assert "in the UNet's graph: %d calls" % STEPS in __import__(
        "sd_accel.hosts.comfyui.controlnet", fromlist=["summary"]).summary(info)


def _step_key(cns, links, monkeypatch, model):
    """The graph key and the hint inputs of the first deferred step of one prompt."""
    from sd_accel.engine.graphs import keys
    seen = _spy_inputs(monkeypatch)
    acc, pos, neg, _ = _accelerated(model, *_conds(cns, links))
    _sample(acc, pos, neg)
    key = keys.flatten(seen[0]).key
    return key, seen[0]["hints"]


def test_graph_key_follows_what_a_replay_bakes_in(env, monkeypatch):
    model, cns = env
    base = [(0, _hint(1), 0.8, (0.0, 1.0))]
    k1, h1 = _step_key(cns, base, monkeypatch, model)
    k2, _ = _step_key(cns, base, monkeypatch, model)
    assert k1 == k2, "a later prompt's new copies of the same ControlNet replay the same graph"
    k3, h3 = _step_key(cns, [(0, _hint(2), 0.8, (0.0, 1.0))], monkeypatch, model)
    assert k3 == k1 and not torch.equal(h3[0], h1[0]), "a new hint image is an input, copied in: same graph"
    assert _step_key(cns, [(0, _hint(1), 0.5, (0.0, 1.0))], monkeypatch, model)[0] != k1, "strength is baked in"
    assert _step_key(cns, [(1, _hint(1), 0.8, (0.0, 1.0))], monkeypatch, model)[0] != k1, "another ControlNet"


def test_weights_change_moves_the_key(env, monkeypatch):
    model, cns = env
    base = [(0, _hint(1), 0.8, (0.0, 1.0))]
    k1, _ = _step_key(cns, base, monkeypatch, model)
    p = next(cns[0].control_model.parameters())
    with torch.no_grad():
        old = p.data
        p.data = p.data.clone()   # new storage: what a reload or a patch does
    try:
        assert _step_key(cns, base, monkeypatch, model)[0] != k1
    finally:
        p.data = old


def test_a_link_that_is_not_ours_runs_the_chain_stock(env, monkeypatch):
    """A chain with a link the converter leaves stock (another pack's class, here below ours) is not
    deferred: ComfyUI's own get_control runs, the result is stock's, and the report says why."""
    import comfy.controlnet
    from sd_accel.hosts.comfyui import controlnet as host_cn
    model, cns = env

    class Theirs(comfy.controlnet.ControlNet):
        pass
    theirs = cns[1].copy().set_cond_hint(_hint(2).movedim(-1, 1), 0.7)
    theirs.__class__ = Theirs
    ours = cns[0].copy().set_cond_hint(_hint(1).movedim(-1, 1), 0.8).set_previous_controlnet(theirs)
    g = torch.Generator().manual_seed(11)
    pos = [[torch.randn(1, 77, 768, generator=g), {"control": ours}]]
    neg = [[torch.randn(1, 77, 768, generator=g), {"control": ours}]]
    ref = _sample(model, pos, neg)
    seen = _spy_inputs(monkeypatch)
    acc, pos2, neg2, info = _accelerated(model, pos, neg)
    assert torch.equal(_sample(acc, pos2, neg2), ref)
    assert not seen and info["one_graph"] == {"deferred": 0, "stock": {"Theirs in the chain is not ours": STEPS}}
    assert "own graphs: %d (Theirs in the chain is not ours)" % STEPS in host_cn.summary(info)


def test_deferred_only_where_our_step_sees_the_control_first(env, monkeypatch):
    """Accelerated KSampler defers the chain only where our step is the first to see apply_model's control:
    graphs on, a GPU, and no other pack's wrapper outside ours (it would get the deferred chain instead of
    residuals). Keyed wrappers on current ComfyUI, the single-slot model_function_wrapper on 2024's."""
    from sd_accel.hosts.comfyui import accelerate as host
    model, _ = env
    opts = host.AccelOptions(fused_kernels=False, channels_last=False)
    acc, info = host.accelerate(model, opts)
    assert not host.runs_controlnets_in_graph(acc, info), "on the CPU: no graph to run the chain in"
    monkeypatch.setattr(host, "_loads_on_cuda", lambda p: True)
    assert host.runs_controlnets_in_graph(acc, info)
    off, off_info = host.accelerate(model, host.AccelOptions(fused_kernels=False, channels_last=False,
                                                             cuda_graph=False))
    assert not host.runs_controlnets_in_graph(off, off_info)

    def theirs(*a, **k):
        raise AssertionError("not called here")
    other = model.clone()
    if hasattr(other, "add_wrapper_with_key"):
        import comfy.patcher_extension as pe
        other.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, "another_pack", theirs)
    else:
        other.set_model_unet_function_wrapper(theirs)
    acc2, info2 = host.accelerate(other, opts)
    assert not host.runs_controlnets_in_graph(acc2, info2)


def test_full_range_is_decided_without_reading_the_timestep(env):
    """Reading t[0] waits for the GPU (t is computed there): for start 0 / end 1, ComfyUI's range is
    (999999999.9, 0.0), which no sigma can leave, so the step must not read t. Any other range is tested
    exactly as ComfyUI tests it."""
    import types
    from sd_accel.hosts.comfyui import control_graph as cg
    import comfy.model_sampling as ms_mod
    model, _ = env
    ms = model.model.model_sampling
    assert isinstance(ms, ms_mod.ModelSamplingDiscrete)
    full = types.SimpleNamespace(timestep_range=(ms.percent_to_sigma(0.0), ms.percent_to_sigma(1.0)))

    class Unreadable:
        def __getitem__(self, i):
            raise AssertionError("the timestep was read")
    assert cg._in_range(full, Unreadable())
    part = types.SimpleNamespace(timestep_range=(ms.percent_to_sigma(0.3), ms.percent_to_sigma(0.7)))
    lo, hi = part.timestep_range[1], part.timestep_range[0]
    assert cg._in_range(part, torch.tensor([(lo + hi) / 2]))
    assert not cg._in_range(part, torch.tensor([hi * 1.01])) and not cg._in_range(part, torch.tensor([lo * 0.99]))


@pytest.fixture(scope="module")
def union_cn(env):
    cn = comfy_inproc.fixtures_module().union_controlnet(comfy_inproc.COMFY, "tiny", seed=5)
    if cn is None:
        pytest.skip("this ComfyUI (2024) has no ControlNet Union")
    return cn


def _typed(cn, type_name):
    """ComfyUI's SetUnionControlNetType on `cn`: a copy with `control_type` in its extra arguments."""
    from comfy_extras.nodes_controlnet import SetUnionControlNetType
    return SetUnionControlNetType().set_controlnet_type(cn, type_name)[0]


def test_a_union_controlnets_type_is_in_the_key_and_each_type_gives_stocks_latent(env, union_cn, monkeypatch):
    """ControlNet Union (ControlNet++): SetUnionControlNetType picks the control type, which the union model turns
    into a one-hot embedding and a task-embedding row inside its forward: a replay bakes it in, so each type must
    be its own graph, and a prompt that switches the type (depth, then canny, same hint) never replays the other's."""
    model, _ = env
    spec = [(0, _hint(1), 0.8, (0.0, 1.0))]
    types = {t: _typed(union_cn, t) for t in ("depth", "canny/lineart/anime_lineart/mlsd", "auto")}
    refs = {t: _sample(model, *_conds([cn], spec)) for t, cn in types.items()}
    moved = float((refs["depth"] - refs["auto"]).norm() / refs["auto"].norm())
    assert moved > 1e-3 and not torch.equal(refs["depth"], refs["canny/lineart/anime_lineart/mlsd"]), moved
    for t, cn in types.items():
        acc, pos, neg, info = _accelerated(model, *_conds([cn], spec))
        out = _sample(acc, pos, neg)
        assert torch.equal(out, refs[t]), (t, float((out - refs[t]).abs().max()))
        assert info["one_graph"] == {"deferred": STEPS, "stock": {}}, (t, info["one_graph"])
    keys = {t: _step_key([cn], spec, monkeypatch, model)[0] for t, cn in types.items()}
    assert len(set(keys.values())) == 3, "two control types would replay one graph"
    assert _step_key([_typed(union_cn, "depth")], spec, monkeypatch, model)[0] == keys["depth"], \
        "a later prompt's SetUnionControlNetType copy of the same type replays the same graph"
