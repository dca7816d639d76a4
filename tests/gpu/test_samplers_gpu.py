"""Samplers and schedulers beyond euler, with CUDA graphs (the CPU server tests run them without graphs): what a
sampler does between the UNet calls (ancestral and SDE noise, two calls per step, CFG++'s post-CFG function, an
adaptive step size) must neither reach a stale replay nor make each prompt capture again.

Per sampler, on the current ComfyUI in process: stock KSampler, then the Accelerated KSampler twice with the same
seed: both runs equal stock's latent within fp16 noise, the first replays graphs, the second reuses them (no new
capture, no refused call).
"""
import pytest
import torch

from test_graphs_gpu import _rel, comfy_env  # noqa: F401  (the shared module fixture)

# (sampler, scheduler): ComfyUI's own samplers a user picks in KSampler, each kind of step once
CASES = [("euler_ancestral", "normal"), ("heun", "karras"), ("dpm_2_ancestral", "karras"),
         ("dpmpp_2m", "karras"), ("dpmpp_sde", "karras"), ("dpmpp_2m_sde", "exponential"),
         ("dpmpp_3m_sde", "sgm_uniform"), ("lcm", "simple"), ("ddim", "ddim_uniform"), ("uni_pc", "beta"),
         ("euler_cfg_pp", "normal"), ("dpmpp_2m_cfg_pp", "karras"), ("res_multistep", "normal"),
         ("er_sde", "normal"), ("seeds_2", "normal"), ("sa_solver", "normal"), ("dpm_adaptive", "normal")]
TOL = {"dpm_adaptive": 5e-2}   # its step sizes follow error estimates, so fp16 noise may move an accepted step


def _run(env, sampler, scheduler, ours, seed=5, steps=6, size=256):
    with torch.inference_mode():
        lat = env.nodes.EmptyLatentImage().generate(size, size, 1)[0]
        args = (env.model, seed, steps, 7.0, sampler, scheduler, env.pos, env.neg, lat)
        if ours:
            res = env.ours.sample(*args)
            return res["result"][0]["samples"].float(), res["ui"]["sdaccel_report"][0]
        return env.nodes.KSampler().sample(*args)[0]["samples"].float(), None


@pytest.mark.parametrize("sampler,scheduler", CASES, ids=["%s-%s" % c for c in CASES])
def test_sampler_with_graphs_equals_stock_and_reuses_its_graphs(comfy_env, sampler, scheduler):
    import comfy.samplers
    # tests/gpu runs on the current ComfyUI, which has every one of them: a missing one is a failure, not a skip
    assert sampler in comfy.samplers.KSampler.SAMPLERS and scheduler in comfy.samplers.KSampler.SCHEDULERS, \
        "this ComfyUI has no %s / %s" % (sampler, scheduler)
    stock, _ = _run(comfy_env, sampler, scheduler, ours=False)
    first, rep1 = _run(comfy_env, sampler, scheduler, ours=True)
    second, rep2 = _run(comfy_env, sampler, scheduler, ours=True)
    tol = TOL.get(sampler, 2e-2)
    assert torch.isfinite(stock).all()
    assert _rel(first, stock) < tol and _rel(second, stock) < tol, (_rel(first, stock), _rel(second, stock))
    assert rep1["graphs"]["replays"] >= 1, rep1["graphs"]
    g = rep2["graphs"]
    assert g["replays"] >= 1 and g["captures"] == 0 and not g.get("refused"), g
