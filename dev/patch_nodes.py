"""ComfyUI's own model patch nodes that SD1.5 and SDXL users put between the checkpoint and the sampler.

One table of cases (node ids and inputs) for the server tests (tests/server/test_patch_nodes.py), the GPU
tests (tests/gpu/test_patch_nodes_gpu.py) and the benchmark (bench/bench_patches.py), and how to apply a
node in-process the way ComfyUI's executor calls it: a v1 node through its FUNCTION, a v3 node (comfy_api
`io.ComfyNode`) through its classmethod `execute`. Stdlib only at import time (ComfyUI is imported when a
node is applied), so the server tests can read the table without importing ComfyUI.
"""
import importlib

# the comfy_extras module that defines each node (current ComfyUI and ComfyUI 2024 agree where both have it)
NODE_MODULES = {
    "FreeU_V2": "nodes_freelunch", "FreeU": "nodes_freelunch",
    "PerturbedAttentionGuidance": "nodes_pag", "SelfAttentionGuidance": "nodes_sag",
    "TomePatchModel": "nodes_tomesd", "HyperTile": "nodes_hypertile",
    "RescaleCFG": "nodes_model_advanced", "ModelSamplingDiscrete": "nodes_model_advanced",
    "ModelSamplingContinuousEDM": "nodes_model_advanced", "ModelSamplingContinuousV": "nodes_model_advanced",
    "ModelComputeDtype": "nodes_model_advanced",
    "UNetSelfAttentionMultiply": "nodes_attention_multiply", "UNetCrossAttentionMultiply": "nodes_attention_multiply",
    "EasyCache": "nodes_easycache", "LazyCache": "nodes_easycache",
    "PatchModelAddDownscale": "nodes_model_downscale",
    "APG": "nodes_apg", "CFGZeroStar": "nodes_cfg", "CFGNorm": "nodes_cfg", "TCFG": "nodes_tcfg",
    "Mahiro": "nodes_mahiro", "FreSca": "nodes_fresca", "Epsilon Scaling": "nodes_eps",
    "HypernetworkLoader": "nodes_hypernetwork", "DifferentialDiffusion": "nodes_differential_diffusion",
}
# dev/fixtures.py's random hypernetwork, in the models' hypernetworks folder (its layers are a patch's own modules,
# outside the UNet, which the host moves with `.to()` at every load and unload)
HYPERNETWORK = "sdaccel_random_hypernet15.pt"
# the case whose model comes from UNETLoader with weight_dtype fp8_e4m3fn instead of a patch node
FP8_UNET = "UNETLoader_fp8_e4m3fn"
# strong enough to move a small random model's image by far more than fp16 noise (v and out dominate)
ATTN_SCALES = {"q": 0.8, "k": 1.2, "v": 2.0, "out": 1.5}
# ToMe merges only at the first level; 0.75 (tomesd's upper range) moves a 256 px image by 4%, 0.3 by 2%
TOME = ("TomePatchModel", {"ratio": 0.75})
FREEU_V2 = ("FreeU_V2", {"b1": 1.3, "b2": 1.4, "s1": 0.9, "s2": 0.2})
FREEU = ("FreeU", {"b1": 1.1, "b2": 1.2, "s1": 0.9, "s2": 0.2})
V_PREDICTION = ("ModelSamplingDiscrete", {"sampling": "v_prediction", "zsnr": False})
EPS_ZSNR = ("ModelSamplingDiscrete", {"sampling": "eps", "zsnr": True})
X0 = ("ModelSamplingDiscrete", {"sampling": "x0", "zsnr": False})
CONTINUOUS_V = ("ModelSamplingContinuousV", {"sampling": "v_prediction", "sigma_max": 500.0, "sigma_min": 0.03})
# the model's layers cast to bf16 on every call and its input cast to bf16 (an object patch whose value is a
# torch.dtype, not a module; force_cast_weights on the patcher)
COMPUTE_BF16 = ("ModelComputeDtype", {"dtype": "bf16"})
EDM = ("ModelSamplingContinuousEDM", {"sampling": "v_prediction", "sigma_max": 120.0, "sigma_min": 0.002})
# Deep Shrink: end_percent 0.5 puts the first half of the steps at half size and the rest at full size, so
# both phases run in any schedule of two steps or more
DEEP_SHRINK = ("PatchModelAddDownscale", {"block_number": 3, "downscale_factor": 2.0, "start_percent": 0.0,
                                          "end_percent": 0.5, "downscale_after_skip": True,
                                          "downscale_method": "bicubic", "upscale_method": "bicubic"})


# Guidance nodes: they change CFG's inputs or result outside the UNet call (pre- and post-CFG functions). APG with
# a negative momentum keeps a running average across steps in its closure; Epsilon Scaling at 1.1 (its range is
# 0.5-1.5; the default 1.005 moves a few-step image too little to tell a lost patch from noise).
GUIDANCE = {
    "APG": [("APG", {"eta": 0.5, "norm_threshold": 5.0, "momentum": -0.5})],
    "CFGZeroStar": [("CFGZeroStar", {})],
    "CFGNorm": [("CFGNorm", {"strength": 1.0})],
    "TCFG": [("TCFG", {})],
    "Mahiro": [("Mahiro", {})],
    "Epsilon Scaling": [("Epsilon Scaling", {"scaling_factor": 1.1})],
}


# EasyCache / LazyCache at their default threshold, from the first step to the last: they skip steps even in a
# 4-step schedule (64 px: 1 and 2 of 4; 256 px: 1 and 3 of 6)
CACHE = {"reuse_threshold": 0.2, "start_percent": 0.0, "end_percent": 1.0, "verbose": False}


def cases(size):
    """{case id: [(node id, inputs), ...] in graph order} for `size` px images. HyperTile's tile is half the
    image, so it really tiles (an image no larger than the tile is one tile: the patch would change nothing)."""
    return {
        "FreeU_V2": [FREEU_V2],
        "FreeU": [FREEU],
        "PerturbedAttentionGuidance": [("PerturbedAttentionGuidance", {"scale": 3.0})],
        "SelfAttentionGuidance": [("SelfAttentionGuidance", {"scale": 0.5, "blur_sigma": 2.0})],
        "TomePatchModel": [TOME],
        "HyperTile": [("HyperTile", {"tile_size": size // 2, "swap_size": 2, "max_depth": 0, "scale_depth": False})],
        "RescaleCFG": [("RescaleCFG", {"multiplier": 0.7})],
        "UNetSelfAttentionMultiply": [("UNetSelfAttentionMultiply", ATTN_SCALES)],
        "UNetCrossAttentionMultiply": [("UNetCrossAttentionMultiply", ATTN_SCALES)],
        "ModelSamplingDiscrete_v_prediction": [V_PREDICTION],
        "ModelSamplingDiscrete_eps_zsnr": [EPS_ZSNR],
        "ModelSamplingDiscrete_x0": [X0],
        "ModelSamplingContinuousEDM": [EDM],
        "ModelSamplingContinuousV": [CONTINUOUS_V],
        "ModelComputeDtype_bf16": [COMPUTE_BF16],
        "EasyCache": [("EasyCache", CACHE)],
        "LazyCache": [("LazyCache", CACHE)],
        "PatchModelAddDownscale": [DEEP_SHRINK],
        FP8_UNET: [],
        # FreSca's low band is the centre `freq_cutoff` indices each way: an eighth of the latent's side
        "FreSca": [("FreSca", {"scale_low": 0.9, "scale_high": 1.25, "freq_cutoff": max(1, size // 64)})],
        "HypernetworkLoader": [("HypernetworkLoader", {"hypernetwork_name": HYPERNETWORK, "strength": 1.0})],
        **GUIDANCE,
    }


# cases added after bench/bench_patches.py's default pass was sized to its time limit: that pass leaves them out,
# and gpu_battery.sh's part patches_more measures them
LATER = ("ModelSamplingDiscrete_x0", "FreSca", "HypernetworkLoader", "ModelSamplingContinuousV",
         "ModelComputeDtype_bf16") + tuple(GUIDANCE)


def node_class(node_id):
    """The class ComfyUI registers as `node_id` (comfy_extras must be importable: ComfyUI on sys.path)."""
    module = importlib.import_module("comfy_extras." + NODE_MODULES[node_id])
    found = getattr(module, "NODE_CLASS_MAPPINGS", {}).get(node_id)
    if found is not None:
        return found
    for obj in vars(module).values():
        if isinstance(obj, type) and "define_schema" in vars(obj) and obj.define_schema().node_id == node_id:
            return obj
    raise KeyError("%s is not defined in comfy_extras.%s" % (node_id, NODE_MODULES[node_id]))


def apply_node(node_id, model, inputs):
    """The MODEL output of node `node_id` on `model` (ComfyUI's executor runs nodes under inference mode)."""
    import torch
    cls = node_class(node_id)
    with torch.inference_mode():
        if "define_schema" in vars(cls):   # a v3 node
            out = cls.execute(model=model, **inputs)
        else:
            out = getattr(cls(), cls.FUNCTION)(model=model, **inputs)
    return out[0]


def apply_case(model, nodes):
    for node_id, inputs in nodes:
        model = apply_node(node_id, model, inputs)
    return model


def provide_hypernetwork(folder):
    """dev/fixtures.py's random hypernetwork in `folder` (built once), registered as ComfyUI's hypernetworks
    folder: for in-process use (the servers find it in the models' hypernetworks folder)."""
    import os
    import folder_paths
    import fixtures
    path = os.path.join(folder, HYPERNETWORK)
    fixtures.ensure(path, fixtures.build_hypernetwork, path)
    folder_paths.add_model_folder_path("hypernetworks", folder, is_default=True)


def load_fp8_unet(unet_name, weight_dtype="fp8_e4m3fn"):
    """UNETLoader with weight_dtype fp8_e4m3fn (current ComfyUI loads a checkpoint's UNet this way too), or another
    of its fp8 choices (fp8_e4m3fn_fast: ComfyUI's fp8_ops Linears on sm_89/sm_90)."""
    import torch
    import nodes
    with torch.inference_mode():
        return nodes.UNETLoader().load_unet(unet_name, weight_dtype)[0]


def add_capture_breaking_patch(model):
    """A clone of `model` with an input-block patch that synchronises the device only while a CUDA graph is being
    captured, which invalidates the capture; for the values it is the identity, so stock KSampler and an eager
    accelerated run give the same image. It misbehaves only inside a capture, where no probe that runs the step
    eagerly can see it: it stands for whatever makes a real capture fail after every check passed (an op a probe
    does not model, a driver error)."""
    import torch

    def sync_inside_capture(h, transformer_options):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()   # not permitted while capturing
        return h
    clone = model.clone()
    clone.set_model_input_block_patch(sync_inside_capture)
    return clone


CAPTURE_BREAKING_NAME = "sync_inside_capture"


def _callables(obj, out):
    if callable(obj) and not isinstance(obj, type):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _callables(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _callables(v, out)
    return out


def _name_of(fn):
    names = {getattr(fn, "__name__", None) or type(fn).__name__}
    module = getattr(fn, "__module__", None) or type(fn).__module__
    names.add(module.rsplit(".", 1)[-1])
    return names


def patch_names(base, patched, node_ids=()):
    """What a line naming the patch on `patched` (a clone of `base` with patch nodes applied) can say: the node
    ids, the names and modules of the functions it added to model_options, its wrapper keys and its
    object-patch paths."""
    names = set(node_ids)
    known = {id(f) for f in _callables(base.model_options, [])}
    for fn in _callables(patched.model_options, []):
        if id(fn) not in known:
            names |= _name_of(fn)
    for kind, keyed in getattr(patched, "wrappers", {}).items():
        for key, fns in keyed.items():
            if key not in getattr(base, "wrappers", {}).get(kind, {}):
                names.add(key)
                for fn in fns:
                    names |= _name_of(fn)
    names |= set(patched.object_patches) - set(base.object_patches)
    return {n for n in names if n}


def names_any(lines, names):
    """True when one of `lines` mentions one of `names` (case-insensitive)."""
    text = " ".join(lines).lower()
    return any(n.lower() in text for n in names)
