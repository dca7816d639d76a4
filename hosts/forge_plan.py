"""Which of Forge's UNet modules SD Accel replaces, computed once per UNet and filtered per sampling run.

The plan (`plan_for`) is made on the unpatched UNet the first time a model is seen, and its modules are kept
(on the KModel, `ForgeState`), so every run hands Forge the same objects:
* engine/patching.py's GroupNorm(+SiLU) and LayerNorm rules, in two variants: with the SiLU after a
  ResBlock's norm folded into it, and without (for a patcher with a `group_norm_wrapper`: Forge's ResBlock
  then calls the norm alone and the rest of its Sequential after it, which would skip a folded SiLU);
* GEGLU: Forge builds `GEGLU.proj` with its own `Linear` (an nn.Module, not an nn.Linear), so the engine's
  GEGLU rule does not see it; planned here for Forge's GEGLU whose forward is the one the kernel
  reproduces (proj, chunk in two, exact GELU). The fused GEGLU calls Forge's Linear itself (its casting,
  its LoRA);
* the ResBlock and transformer-block stand-ins (engine/patches/fused_resblock.py, fused_transformer_block.py:
  the timestep embedding and biases folded into the norms, the residual adds into the LayerNorms), in the
  variant with folded SiLUs only (with a `group_norm_wrapper` a ResBlock hands its norms to the wrapper, and
  the stand-in then runs Forge's own `_forward`). The ResBlocks' timestep projections run as one GEMM over
  Forge's Linear where its forward is `F.linear` of its weight and bias as read (`_register_linear`);
* channels_last stand-ins of the SpatialTransformers (engine/layout_modules.py).
Only Forge's own classes are planned (torch's, backend.operations', the UNet's package's): a module
another extension put in is left alone.

Each replacement shares its original's parameter table (`_parameters`, `_buffers`), not only the
Parameters: Forge's LoRA loader merges a LoRA by putting new Parameter objects on whichever module stands at
the path and keeps them across runs (it reloads only when the LoRA set changes), so with one table a LoRA
merged while SD Accel was on is there when it is off, and the other way round. Replacements carry no
`parameters_manual_cast`: Forge's memory manager then keeps them whole on the GPU (a norm's weight and bias)
instead of asking them to cast per call, which their forward does not do.

Per run (`run_patches`), left to Forge: modules it casts on the fly (`parameters_manual_cast`: low-precision
storage, or the lowvram swap), with an fp8 `scale_weight`, under an online LoRA (merged in Forge's own
forward), at or around a path another extension patches, or no longer where the plan found them. A block
stand-in reads its children's weights itself, so it is left to Forge where any module inside it is.
"""
from torch import nn

from ..engine.patches import emb_projections
from ..engine.patches import fused_modules as fm
from ..engine.patches import layout_modules, patching
from . import webui
from .attached import state_on

NORM_OPS = ("group_norm", "layer_norm")
BLOCK_OPS = ("resblock_add_norm", "transformer_add_norm")
BLOCK_KINDS = ("resblock", "transformer_block")
PREFIX = "diffusion_model."          # object patch paths are relative to the KModel
_HOST_PACKAGES = ("backend", "torch")   # Forge's operations (backend.operations) and torch's own modules
_GEGLU_STEPS = ("self.proj(x)", "chunk(2", "gelu(gate)")
_LINEAR_STEPS = ("get_weight_and_bias(self)", "functional.linear(x, weight, bias)")


class ForgeState:
    """Per KModel (one loaded checkpoint): the plan, its graphs, what the last run did."""

    def __init__(self):
        self.sources = None     # path -> the module Forge put there
        self.variants = {}      # fold_silu -> {path: replacement}
        self.layout = {}        # path -> channels_last SpatialTransformer stand-in
        self.keys_ok = True     # every replacement has its original's state_dict keys
        self.graphs = None
        self.eager_paths = None  # steps run without graphs: the faster of the fused and the stock modules
        self.epoch = None       # one object per sampling run
        self.channels_last_epoch = None
        self.channels_last = False
        self.run_graphs = True  # this run may replay graphs (no online LoRA)
        self.steps = {}         # options -> the step function (one stable object each)
        self.last = None        # what the last run (or the model-load preview) applied
        self.patches = None     # the last run's {path: replacement}
        self.patch_token = None  # a new object whenever that set changes (part of the graph key)
        self.structure = (None, None)   # (epoch, webui.structure_signature) for the graph key
        self.forwards = None    # (epoch, another extension's module forward in the UNet or None), read once a run
        self.runs = 0
        self.wrapper_calls = 0  # UNet calls through SD Accel's model_function_wrapper (each step's, each tile's)
        self.outside_calls = 0  # UNet calls with SD Accel's modules in but not through its step (forge_calls.py)
        self.call_hooks = None  # unet_call_hooks.CallHooks around the UNet's calls (forge_calls.py)
        self.unfused = {}       # fused norm+SiLU -> the norm it stands for (for a late group_norm_wrapper)
        self.shim = None        # (group_norm_wrapper, its stand-in)
        self.clones = {}        # options -> (weakref to the patcher, its signature, our clone, info, its leaves)
        self.controlnet_hooks = {}   # options -> the ControlNet hook (hosts/forge_controlnet.py)


_STATE_ATTR = "_sd_accel_forge"


def state_of(kmodel):
    return state_on(kmodel, _STATE_ATTR, ForgeState)


def is_ours(m):
    return fm.is_fused(m)


def _forge_class(m, unet):
    """`m`'s class is Forge's: torch's, Forge's operations', or from the package of the UNet's class."""
    top = type(m).__module__.split(".")[0]
    return top in _HOST_PACKAGES or top == type(unet).__module__.split(".")[0]


def _plan_geglu(unet):
    out = {}
    for name, mod in unet.named_modules():
        cls = fm.original_class(mod)
        if cls.__name__ != "GEGLU" or not isinstance(getattr(mod, "proj", None), nn.Module):
            continue
        src = fm.host_source(cls, "forward", ("self", "x"))
        if src is not None and all(step in src for step in _GEGLU_STEPS):
            out[name] = fm.make_fused_geglu(mod)
    return out


def _register_linear(unet):
    """Forge's own Linear (an nn.Module, not an nn.Linear) counts as a Linear for the ResBlocks' batched
    timestep projection where its forward, when it does not cast, is F.linear of its weight and bias as
    `get_weight_and_bias` returns them (those are `weight` and `bias` themselves unless the module casts on the
    fly, scales or merges an online LoRA: run_patches leaves such blocks to Forge)."""
    for mod in unet.modules():
        cls = type(mod)
        if cls.__name__ == "Linear" and not isinstance(mod, nn.Linear) and _forge_class(mod, unet):
            src = fm.host_source(cls, "forward", ("self", "x"))
            if src is not None and all(step in src for step in _LINEAR_STEPS):
                emb_projections.register_linear(cls)


def _share_tables(rep, src):
    if isinstance(rep, fm.SiLUFolded):
        return
    for d in ("_parameters", "_buffers"):
        rep.__dict__[d] = src.__dict__[d]
    for k in ("parameters_manual_cast", "prev_parameters_manual_cast"):
        rep.__dict__.pop(k, None)
    if fm.kind_of(rep) in NORM_OPS:
        # Forge's norm forwards read `parameters_manual_cast`, which the replacement lacks: where the stock path
        # is wanted it runs torch's forward, Forge's own computation for a module it does not cast
        rep.__dict__["sdaccel_stock_forward"] = next(c.forward for c in type(src).__mro__
                                                     if c.__module__.startswith("torch.nn"))


def plan_for(st, unet, classes_of=None):
    """Makes the plan on the unpatched `unet` (once). False when `unet` already holds replacements that
    are not this state's (nothing is planned then). `classes_of`: the module whose package's classes count as
    Forge's besides Forge's operations and torch's (default `unet`; a ControlNet's control model: the UNet)."""
    if st.sources is not None:
        return True
    if webui.count_fused(unet):
        return False
    _register_linear(unet)
    fold = patching.plan_patches(unet, ("group_norm_silu",) + NORM_OPS + BLOCK_OPS, owner=unet).patches
    plain = patching.plan_patches(unet, NORM_OPS).patches
    geglu = _plan_geglu(unet)
    layout = layout_modules.plan_layout_patches(unet)
    for path, rep in plain.items():   # the same object where both variants replace a module alike
        other = fold.get(path)
        if other is not None and not getattr(other, "sdaccel_act", None):
            plain[path] = other
    fold.update(geglu)
    plain.update(geglu)
    sources, theirs = {}, []
    for patches in (fold, plain, layout):
        for path in patches:
            src = patching.get_attr(unet, path)
            if _forge_class(src, classes_of if classes_of is not None else unet):
                sources[path] = src
            else:
                theirs.append(path)
    fold, plain, layout = (webui.drop_with_partners(p, theirs) for p in (fold, plain, layout))
    keys_ok = True
    for patches in (fold, plain, layout):
        for path, rep in patches.items():
            _share_tables(rep, sources[path])
            keys_ok &= list(rep.state_dict().keys()) == list(sources[path].state_dict().keys())
    st.sources, st.variants, st.layout, st.keys_ok = sources, {True: fold, False: plain}, layout, keys_ok
    st.unfused = {rep: sources[path] for path, rep in fold.items() if getattr(rep, "sdaccel_act", None)}
    return True


def _inside(path, paths):
    return any(p == path or p.startswith(path + ".") for p in paths)


def _reads_weights_on_the_fly(rep, src):
    """Forge computes weights this replacement reads in its own forward: the module's own, or for a block
    stand-in any module's inside it."""
    if fm.kind_of(rep) in BLOCK_KINDS:
        return any(casts_on_the_fly(m) for m in src.modules())
    return casts_on_the_fly(src)


def casts_on_the_fly(m):
    """Forge computes this module's weights in its own forward (cast, scaled or LoRA-merged per call)."""
    manual = m.__dict__.get("prev_parameters_manual_cast", getattr(m, "parameters_manual_cast", False))
    return bool(manual) or getattr(m, "scale_weight", None) is not None or hasattr(m, "forge_online_loras")


def online_lora_paths(patcher):
    """Module paths (UNet-relative) whose weights an online LoRA of `patcher` patches."""
    out = set()
    for ident, patches in getattr(patcher, "lora_patches", {}).items():
        if len(ident) > 3 and ident[3]:
            for key in patches:
                out.add(key[len(PREFIX):].rpartition(".")[0] if key.startswith(PREFIX) else key)
    return out


def _conflicts(path, foreign):
    return any(path == f or path.startswith(f + ".") or f.startswith(path + ".") for f in foreign)


def run_patches(st, patcher, unet, fold, layout):
    """({path: replacement} for this run, {reason: paths left to Forge}). `patcher`'s own object patches
    that are not ours count as another extension's."""
    variant = dict(st.variants[fold])
    if layout:
        variant.update(st.layout)
    foreign = [k[len(PREFIX):] if k.startswith(PREFIX) else k
               for k, v in patcher.object_patches.items() if not is_ours(v)]
    online = online_lora_paths(patcher)
    skipped = {}
    for path, rep in variant.items():
        src = st.sources[path]
        try:
            live = patching.get_attr(unet, path)
        except AttributeError:
            live = None
        why = None
        if live is not src and not is_ours(live):
            why = "changed since the plan"
        elif _conflicts(path, foreign):
            why = "another extension's object patch"
        elif path in online or (fm.kind_of(rep) in BLOCK_KINDS and _inside(path, online)):
            why = "online LoRA"
        elif _reads_weights_on_the_fly(rep, src):
            why = "Forge casts it on the fly"
        if why:
            skipped.setdefault(why, []).append(path)
    return webui.drop_with_partners(variant, [p for paths in skipped.values() for p in paths]), skipped

