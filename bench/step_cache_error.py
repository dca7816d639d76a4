#!/usr/bin/env python3
"""How far the step cache (DeepCache, LOSSY) moves a UNet's activations, block by block, on random weights.

On an SD1.5 UNet with random weights (dev/fixtures.py) and on the same weights given heavy-tailed outlier channels
(in every conv and linear layer a few output channels, 1 % or at least one, scaled by factors drawn log-uniformly
from 10..100, as trained SD weights carry a few channels far above the rest), it runs a 20-step euler CFG
trajectory with the whole UNet and, at each step a schedule runs cached, the cached call on that step's input:
  * per block: relative L2 error of each output block that runs on cached steps, cached vs the whole UNet;
  * whole UNet: relative L2 error of its output (mean and max over the cached steps);
  * final latent: a trajectory sampled with the step cache vs the one without.
The calls are SD Accel's own (hosts/comfyui/step_cache.py: its DIFFUSION_MODEL wrapper on ComfyUI's UNetModel),
in the model's own dtype (fp16 on a GPU, fp32 on the CPU): the reference is the whole UNet in that dtype. One
record per (weights, mode, branch) goes to <out>/results.jsonl as config `stepcache_error_<weights>_<mode>_b<b>`.
Random weights only: nothing here measures a trained model. Needs current ComfyUI (keyed wrappers).

  python3 bench/step_cache_error.py --comfy-dir vendor/ComfyUI --out $OUT                # CPU: small preset
  python3 bench/step_cache_error.py --comfy-dir vendor/ComfyUI --preset sd15 --size 512 --gpu --out $OUT
"""
import argparse
import datetime
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_bench as cb  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--comfy-dir", default=os.path.join(cb.REPO, "vendor", "ComfyUI"))
ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_out"))
ap.add_argument("--work", default="/tmp/sdaccel_bench")
ap.add_argument("--preset", default="small", help="dev/fixtures.py SD1.5 preset (small, sd15)")
ap.add_argument("--size", type=int, default=128, help="image side in pixels (the latent is 1/8)")
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--cfg", type=float, default=7.0)
ap.add_argument("--modes", default="interval 2,interval 3,non-uniform 3")
ap.add_argument("--branches", default="0,1")
ap.add_argument("--gpu", action="store_true", help="run on the GPU (fp16, as ComfyUI loads it there)")
ap.add_argument("--comfy-args", default="")
OPT = ap.parse_args()
OPT.smoke = not OPT.gpu
ENV = cb.boot(OPT, ("checkpoints",))
torch = ENV.torch
say = cb.say
OUTLIER_SHARE, OUTLIER_MIN, OUTLIER_MAX = 0.01, 10.0, 100.0


def load_patcher():
    import comfy.sd
    path = os.path.join(OPT.work, "checkpoints", "random_sd15_%s.safetensors" % OPT.preset)
    ENV.fixtures.ensure(path, ENV.fixtures.build_checkpoint, OPT.comfy_dir, "sd15", OPT.preset, path, 1234)
    with torch.inference_mode():
        patcher = comfy.sd.load_checkpoint_guess_config(path, output_vae=False, output_clip=False)[0]
    ENV.mm.load_models_gpu([patcher])
    return patcher


def add_outlier_channels(unet, seed=0):
    """Scales a few output channels of every conv and linear weight (and bias) of `unet` in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():   # ComfyUI loaded the weights as inference tensors
        for m in unet.modules():
            if not isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
                continue
            rows = m.weight.shape[0]
            k = max(1, round(OUTLIER_SHARE * rows))
            idx = torch.randperm(rows, generator=g)[:k]
            scale = torch.exp(torch.empty(k).uniform_(math.log(OUTLIER_MIN), math.log(OUTLIER_MAX), generator=g))
            shape = (k,) + (1,) * (m.weight.dim() - 1)
            m.weight[idx.to(m.weight.device)] *= scale.view(shape).to(m.weight)
            if m.bias is not None:
                m.bias[idx.to(m.bias.device)] *= scale.to(m.bias)


class Caller:
    """The UNet's calls as ComfyUI's apply_model makes them, full or cached, through SD Accel's wrapper;
    `blocks` holds each output block's output of the last call."""

    def __init__(self, patcher, branch):
        import comfy.patcher_extension as pe
        from sd_accel.hosts.comfyui import step_cache as sc_host
        self.sc = sc_host
        self.model = patcher.model
        self.unet = self.model.diffusion_model
        self.cache = sc_host.StepCache("interval 2", branch)
        self.wrappers = {pe.WrappersMP.DIFFUSION_MODEL: {sc_host.WRAPPER_KEY: [self.cache.diffusion_model]}}
        self.blocks = {}
        # on the block's last layer: ComfyUI runs a block's layers one by one, never the block's own forward
        self.hooks = [b[-1].register_forward_hook(self._keep(j)) for j, b in enumerate(self.unet.output_blocks)]

    def _keep(self, j):
        def hook(_module, _inputs, out):
            self.blocks[j] = out.float().clone()
        return hook

    def __call__(self, x, sigma, ctx, feature=None):
        """(UNet output, the deep feature of a full call or None) at latent `x`, noise level `sigma`."""
        ms, dt = self.model.model_sampling, self.model.get_dtype()
        s = sigma.expand(x.shape[0])
        xc = ms.calculate_input(s, x).to(dt)
        mark = ("full",) if feature is None else ("cached", feature)
        to = {"wrappers": self.wrappers, self.sc.CALL_OPTION: mark}
        self.blocks = {}
        call = self.sc._keeping_feature(lambda: self.unet(xc, ms.timestep(s).float(), context=ctx.to(dt),
                                                          transformer_options=to))
        out, kept = call()
        return ms.calculate_denoised(s, out.float(), x), out.float(), kept

    def close(self):
        for h in self.hooks:
            h.remove()


def euler_step(x, denoised, sigma, sigma_next):
    return x + (sigma_next - sigma) * (x - denoised) / sigma


def cfg_denoised(d):
    cond, uncond = d.chunk(2)
    return uncond + OPT.cfg * (cond - uncond)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def inputs(patcher):
    import comfy.samplers
    g = torch.Generator().manual_seed(7)
    n = OPT.size // 8
    sigmas = comfy.samplers.calculate_sigmas(patcher.model.model_sampling, "normal", OPT.steps).to(ENV.dev)
    x = (torch.randn(1, 4, n, n, generator=g) * sigmas[0].cpu()).to(ENV.dev)
    ctx = torch.randn(2, 77, 768, generator=g).to(ENV.dev)
    return sigmas, x, ctx


def trajectory(caller, sigmas, x, ctx, full, on_step=None):
    """Euler CFG from `x`; steps in `full` (None: all) run the whole UNet, the others cached on the last kept
    feature. `on_step(i, x)` sees each step's input first. Returns the final latent."""
    feature = None
    for i in range(len(sigmas) - 1):
        if on_step is not None:
            on_step(i, x)
        cached = full is not None and i not in full and feature is not None
        d, _, kept = caller(torch.cat([x, x]), sigmas[i], ctx, feature if cached else None)
        feature = feature if cached else kept
        x = euler_step(x, cfg_denoised(d), sigmas[i], sigmas[i + 1])
    return x


def errors_one_step(caller, sigmas, x0, ctx, modes):
    """{mode: {"blocks": {j: [errors]}, "unet": [errors]}} of cached calls on the whole-UNet trajectory."""
    from sd_accel.engine.step_cache import schedule
    fulls = {m: set(schedule.full_steps(OPT.steps, m)) for m in modes}
    kept_at, out = {}, {m: {"blocks": {}, "unet": []} for m in modes}

    def on_step(i, x):
        with torch.inference_mode():
            _, want, kept_at[i] = caller(torch.cat([x, x]), sigmas[i], ctx)
            want_blocks = dict(caller.blocks)
            for m in modes:
                if i in fulls[m]:
                    continue
                last = max(s for s in fulls[m] if s < i)
                _, got, _ = caller(torch.cat([x, x]), sigmas[i], ctx, kept_at[last])
                out[m]["unet"].append(rel(got, want))
                for j, b in caller.blocks.items():
                    out[m]["blocks"].setdefault(j, []).append(rel(b, want_blocks[j]))
    with torch.inference_mode():
        final = trajectory(caller, sigmas, x0, ctx, None, on_step)
    return out, final


def records(env_info, weights, branch, caller, sigmas, x0, ctx, modes):
    from sd_accel.engine.step_cache import schedule
    one_step, final_full = errors_one_step(caller, sigmas, x0, ctx, modes)
    for m in modes:
        with torch.inference_mode():
            final = trajectory(caller, sigmas, x0, ctx, set(schedule.full_steps(OPT.steps, m)))
        e = one_step[m]
        yield dict(env_info, date=datetime.date.today().isoformat(), steps=OPT.steps, sampler="euler",
                   scheduler="normal", cfg=OPT.cfg, precision=str(caller.model.get_dtype()).replace("torch.", ""),
                   config="stepcache_error_%s_%s_b%d" % (weights, m.replace(" ", "").replace("-", ""), branch),
                   step_cache=m, step_cache_branch=branch, weights=weights, preset=OPT.preset, size=OPT.size,
                   cached_steps=len(e["unet"]),
                   block_rel_err={"output %d" % j: round(sum(v) / len(v), 6) for j, v in sorted(e["blocks"].items())},
                   unet_rel_err_mean=sum(e["unet"]) / len(e["unet"]), unet_rel_err_max=max(e["unet"]),
                   final_latent_rel_err=rel(final, final_full),
                   notes="LOSSY mode; random weights%s: says nothing of a trained model" % (
                       " with outlier channels" if weights == "outliers" else ""))


def main():
    import comfy.model_patcher
    if not hasattr(comfy.model_patcher.ModelPatcher, "add_wrapper_with_key"):
        raise SystemExit("this ComfyUI has no keyed wrappers (ComfyUI 2024): the step cache cannot run on it")
    env_info = cb.versions(ENV, OPT.comfy_dir)
    modes = [m.strip() for m in OPT.modes.split(",") if m.strip()]
    patcher = load_patcher()
    sigmas, x0, ctx = inputs(patcher)
    rows = []
    for weights in ("random", "outliers"):
        if weights == "outliers":
            add_outlier_channels(patcher.model.diffusion_model)
        for branch in (int(b) for b in OPT.branches.split(",")):
            caller = Caller(patcher, branch)
            try:
                for rec in records(env_info, weights, branch, caller, sigmas, x0, ctx, modes):
                    rows.append(rec)
                    cb.append_record(OPT, rec)
            finally:
                caller.close()
    print("%-44s %7s %12s %12s %12s  %s" % ("config", "cached", "unet mean", "unet max", "final latent",
                                            "per output block (mean)"))
    for r in rows:
        print("%-44s %7d %12.3e %12.3e %12.3e  %s" % (
            r["config"], r["cached_steps"], r["unet_rel_err_mean"], r["unet_rel_err_max"], r["final_latent_rel_err"],
            " ".join("%s:%.2e" % (k.split()[1], v) for k, v in r["block_rel_err"].items())))


if __name__ == "__main__":
    main()
