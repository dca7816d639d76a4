"""The step cache (DeepCache, LOSSY) on the GPU: each kind of call (full, cached) captures its own CUDA graph on the
first run and the next run replays both with no eager call (no host sync, no Python branch on tensor data inside a
step), and the replayed run equals the same run without graphs within fp16 noise, while it stays visibly apart
from the lossless image (the cache is on). Run with tests/gpu (bench/gpu_battery.sh part `tests`)."""
from test_graphs_gpu import COMFY, REPO, WORK, _rel, comfy_env  # noqa: F401  (the shared module fixture)

import torch

STEPS = 6


def _run(env, seed=5, **inputs):
    with torch.inference_mode():
        lat = env.nodes.EmptyLatentImage().generate(256, 256, 1)[0]
        res = env.ours.sample(env.model, seed, STEPS, 7.0, "euler", "normal", env.pos, env.neg, lat, **inputs)
        return res["result"][0]["samples"].float(), res["ui"]["sdaccel_report"][0]


def test_both_kinds_of_call_capture_once_then_replay_with_no_eager_call(comfy_env):  # noqa: F811
    _, first = _run(comfy_env, step_cache="interval 2")
    assert first["graphs"]["captures"] >= 2, first["graphs"]   # one graph per kind (at least)
    _, again = _run(comfy_env, seed=6, step_cache="interval 2")
    s = again["step_cache"]
    assert (s["full_calls"], s["cached_calls"], s["cached_steps"]) == (3, 3, 3), s
    g = again["graphs"]
    assert g["captures"] == 0 and g["eager"] == 0 and g["replays"] == STEPS, g
    assert any("LOSSY" in r for r in again["ran"]), again["ran"]


def test_replayed_step_cache_equals_the_eager_one_and_differs_from_lossless(comfy_env):  # noqa: F811
    _run(comfy_env, step_cache="interval 3")                      # captures
    graphed, rep = _run(comfy_env, seed=7, step_cache="interval 3")
    assert rep["graphs"]["replays"] == STEPS, rep["graphs"]
    eager, rep_eager = _run(comfy_env, seed=7, step_cache="interval 3", cuda_graph=False)
    assert rep_eager["graphs"]["replays"] == 0
    lossless, _ = _run(comfy_env, seed=7)
    noise = _rel(graphed, eager)
    assert noise < 2e-2, noise
    assert _rel(graphed, lossless) > 5 * noise, (_rel(graphed, lossless), noise)
