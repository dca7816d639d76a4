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
"""
import argparse
import copy
import json
import os
import sys

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
    print("PROBE " + json.dumps(obs, sort_keys=True))


if __name__ == "__main__":
    main()
