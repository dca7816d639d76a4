#!/usr/bin/env python3
"""One scenario run against Forge's backend (`--forge WEBUI`: the real one, from a Forge tree) or against
SD Accel's stand-in of it (`--stand-in DIR`: tests/hosts/a1111/fake_forge); prints what it observed as one JSON
line. dev/forge_check.py runs both and compares, so the CI tests' stand-in is checked against the real
Forge. Observed:
  linear   Forge's Linear is an nn.Module that is not an nn.Linear, with in/out features and
           parameters_manual_cast, that casts its weights per call when that is set
  norms    Forge's GroupNorm/LayerNorm are torch's classes' subclasses with parameters_manual_cast
  clone    object patches copied shallow, model_options deep (a function keeps its identity)
  load     object patches put in when the patcher is loaded, the originals back when it is unloaded
  lora     a merged LoRA is a new Parameter on whichever module stands at the path when the patcher is
           loaded, not reloaded while the LoRA set is unchanged (a module with a parameter table of its own
           swapped in there takes the LoRA away with it)
  lowvram  modules with parameters_manual_cast set to cast per call, modules without it left as they are,
           and the flags put back at unload
  controlnet  a ControlNet's copy shares the control model with a patcher of its own; UNet patcher clones share
           the ControlNet chain; get_control calls the `controlnet_model_function_wrapper` transformer option with
           x, hint (as prepared), timesteps, context, y, model (the ControlNet) and inner_model (its control
           model), and returns the hook's outputs scaled by the strength; a control-LoRA is a ControlNet subclass
"""
import argparse
import copy
import json
import os
import sys
import types

import torch


def _api(args):
    if args.forge:
        root = os.path.abspath(args.forge)
        sys.path[:0] = [root, os.path.join(root, "packages_3rdparty")]   # as Forge's start-up does
        os.chdir(root)
        sys.argv = sys.argv[:1] + ["--always-cpu", "--all-in-fp32"]   # read by backend.args at import
        from backend import memory_management as mm
        from backend import operations
        from backend.patcher.base import ModelPatcher

        def ops():
            return operations.using_forge_operations(device=torch.device("cpu"), dtype=torch.float32)

        def load(p, lowvram=False):
            if lowvram:
                lm = mm.LoadedModel(p)
                lm.model_load(model_gpu_memory_when_using_cpu_swap=0)
                mm.current_loaded_models.insert(0, lm)
            else:
                mm.load_models_gpu([p])
        return ModelPatcher, ops, load, mm.unload_all_models
    sys.path.insert(0, os.path.abspath(args.stand_in))
    from backend import memory_management as mm
    from backend import operations
    from backend.patcher import ModelPatcher
    return ModelPatcher, operations.using_forge_operations, mm.load_models_gpu, mm.unload_all


class _ControlModel(torch.nn.Module):
    """A control model of the call Forge makes: two outputs from x, the hint, the timesteps and the context."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 1)
        self.dtype = torch.float32   # Forge reads the control model's dtype

    def forward(self, x, hint, timesteps, context, y=None):
        h = self.conv(x) + torch.nn.functional.avg_pool2d(hint, 8).mean(1, keepdim=True) + context.mean()
        return [h, h * 2]


class _Predictor:
    """What a ControlNet reads from the UNet's model in Forge's `pre_run`: the identity for sigmas here."""

    def timestep(self, t):
        return t

    def calculate_input(self, t, x):
        return x


def _unet_patcher_class():
    try:
        from backend.patcher.unet import UnetPatcher   # Forge
    except ImportError:
        from backend.patcher import UnetPatcher        # the stand-in
    return UnetPatcher


def observe_controlnet():
    from backend.patcher import controlnet
    UnetPatcher = _unet_patcher_class()
    cm = _ControlModel()
    g = torch.Generator().manual_seed(1)
    cn = controlnet.ControlNet(cm).set_cond_hint(torch.rand(1, 3, 16, 16, generator=g), 0.5)
    copy_ = cn.copy()
    unet = UnetPatcher(torch.nn.Linear(2, 2), load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    seen = {}

    def hook(**kw):
        seen.update({k: type(v).__name__ for k, v in kw.items()})
        seen["is"] = [kw["model"] is copy_, kw["inner_model"] is cm, tuple(kw["hint"].shape)]
        return kw["inner_model"](x=kw["x"], hint=kw["hint"], timesteps=kw["timesteps"], context=kw["context"],
                                 y=kw["y"])
    unet.set_controlnet_model_function_wrapper(hook)
    m = unet.clone()
    m.add_patched_controlnet(copy_)
    obs = [copy_.control_model is cm, copy_.control_model_wrapped is not cn.control_model_wrapped,
           copy_.control_model_wrapped.model is cm, m.clone().controlnet_linked_list is copy_,
           issubclass(controlnet.ControlLora, controlnet.ControlNet)]
    if hasattr(copy_, "pre_run"):   # Forge: the ControlNet reads the sampling model's predictor and the range
        copy_.pre_run(types.SimpleNamespace(predictor=_Predictor()), lambda p: 1000.0 * (1.0 - p))
    copy_.transformer_options = m.model_options["transformer_options"]
    x = torch.randn(1, 4, 2, 2, generator=g)
    ctx = torch.randn(1, 3, 8, generator=g)
    out = copy_.get_control(x, torch.tensor([500.0]), {"c_crossattn": ctx}, 1)
    direct = cm(x=x, hint=copy_.cond_hint, timesteps=torch.tensor([500.0]), context=ctx)
    flat = [t for v in (out.values() if isinstance(out, dict) else [out]) for t in v if t is not None]
    obs.append(sorted(seen.items(), key=lambda kv: kv[0]) if seen else None)
    obs.append(bool(len(flat) == 2 and all(torch.allclose(a, 0.5 * b) for a, b in zip(sorted(flat, key=lambda t: float(t.sum())),
                                                                                         sorted(direct, key=lambda t: float(t.sum()))))))
    return obs


def _tiny(ops):
    with ops():
        blk = torch.nn.Module()
        blk.norm = torch.nn.GroupNorm(2, 4)
        blk.proj = torch.nn.Linear(4, 8)
        ln = torch.nn.LayerNorm(8)
    root = torch.nn.Module()
    root.blk = blk
    g = torch.Generator().manual_seed(0)
    sd = {"blk.norm.weight": torch.rand(4, generator=g) + 0.5, "blk.norm.bias": torch.rand(4, generator=g),
          "blk.proj.weight": torch.randn(8, 4, generator=g), "blk.proj.bias": torch.randn(8, generator=g)}
    root.load_state_dict(sd, strict=False)
    ln.load_state_dict({"weight": torch.ones(8), "bias": torch.zeros(8)}, strict=False)
    return root, ln


def _own_table_copy(m):
    rep = copy.copy(m)
    rep.__dict__["_parameters"] = dict(m._parameters)
    rep.__dict__.pop("parameters_manual_cast", None)
    return rep


def observe(ModelPatcher, ops, load, unload_all):
    root, ln = _tiny(ops)
    lin, norm = root.blk.proj, root.blk.norm
    x = torch.randn(2, 4, dtype=torch.float64)
    lin.parameters_manual_cast = True
    obs = {"linear": [isinstance(lin, torch.nn.Linear), isinstance(lin, torch.nn.Module),
                      lin.in_features, lin.out_features, sorted(n for n, _ in lin.named_parameters()),
                      str(lin(x).dtype)]}
    lin.parameters_manual_cast = False
    obs["norms"] = [isinstance(norm, torch.nn.GroupNorm), isinstance(ln, torch.nn.LayerNorm),
                    hasattr(norm, "parameters_manual_cast"), hasattr(ln, "parameters_manual_cast")]
    base = ModelPatcher(root, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))

    def wrapper(apply_model, a):
        return apply_model(a["input"], a["timestep"], **a["c"])
    base.set_model_unet_function_wrapper(wrapper)
    rep = _own_table_copy(norm)
    base.add_object_patch("blk.norm", rep)
    c = base.clone()
    obs["clone"] = [c.object_patches is not base.object_patches, c.object_patches["blk.norm"] is rep,
                    c.model_options is not base.model_options, c.model_options["model_function_wrapper"] is wrapper]
    w0 = norm.weight
    delta = torch.full_like(w0, 0.25)
    c.add_patches(filename="probe.safetensors", patches={"blk.norm.weight": ("diff", (delta,))})
    load(c)
    obs["load"] = [root.blk.norm is rep]
    obs["lora"] = [rep.weight is not w0, bool(torch.allclose(rep.weight, w0 + delta)), norm.weight is w0]
    unload_all()
    obs["load"].append(root.blk.norm is norm)
    c2 = base.clone()
    del c2.object_patches["blk.norm"]
    c2.add_patches(filename="probe.safetensors", patches={"blk.norm.weight": ("diff", (delta,))})
    load(c2)
    obs["lora"].append(bool(torch.allclose(root.blk.norm.weight, w0)))   # the same set: not reloaded
    unload_all()
    c3 = base.clone()
    load(c3, lowvram=True)
    obs["lowvram"] = [lin.parameters_manual_cast, norm.parameters_manual_cast, hasattr(rep, "parameters_manual_cast")]
    unload_all()
    obs["lowvram"] += [lin.parameters_manual_cast, norm.parameters_manual_cast]
    return obs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--forge", help="a Forge tree (its backend/ is imported)")
    g.add_argument("--stand-in", help="the stand-in's folder (tests/hosts/a1111/fake_forge)")
    args = ap.parse_args()
    with torch.no_grad():
        obs = observe(*_api(args))
        obs["controlnet"] = observe_controlnet()
    print("PROBE " + json.dumps(obs, sort_keys=True))


if __name__ == "__main__":
    main()
