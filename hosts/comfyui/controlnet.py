"""ComfyUI host, ControlNet side: the engine's patches on ComfyUI's ControlNet objects, reversibly.

What gets patched, as data (`{attribute path: replacement}` from the engine, relative to the cldm module):
  * the fused modules of `engine.patching.plan_patches` (GroupNorm+SiLU, GroupNorm, LayerNorm, GEGLU),
    exactly as on the UNet;
  * `input_hint_block` -> a caching stand-in (`engine.hint_cache`) that computes the hint features once
    per sampling run instead of on every step. Lossless; same child modules and parameter names.
    Not with CUDA graphs: a replay cannot take a Python-side cache decision, and inside the graph the
    block costs ~1% of the ControlNet's GPU time;
  * `forward` -> `engine.graphs.graphed_forward.GraphedForward` when cuda_graph or channels_last is on: the
    whole ControlNet forward replayed from CUDA graphs (one per shape, kept on the cldm module so they
    survive from one prompt to the next, dropped when its weights change or leave the GPU), and its
    conv weights in channels_last. Strength, start/end percent and the merge with the previous
    ControlNet stay outside, in ComfyUI's own code, so they are honoured on every step. With graphs off
    (and fused kernels on) the stand-in is there too: each call takes the faster of the fused and the stock
    modules, measured per shape, the stock path on the folded blocks' originals (stock_blocks.py), as the UNet's
    eager steps do;
  * with `one_graph` (Accelerated KSampler, when the UNet's step takes it): each link's `get_control`
    defers the chain into the UNet's own CUDA graph, so forwards, strength and merge replay with the UNet
    as one graph per step; start/end percent and hint preparation are decided outside the graph on every
    step (hosts/comfyui/control_graph.py). Inside that capture the forward stand-in above runs eagerly.

How it is applied, on both ComfyUI versions (2024-03 and current): a `comfy.controlnet.ControlNet` holds
its cldm module in a ModelPatcher, `control_model_wrapped`, which the sampler loads with the UNet
(`get_models()`). `accelerate_controlnet(cn)` returns `cn.copy()` whose `control_model_wrapped` is a
`clone()` of cn's patcher with one `add_object_patch(path, module)` per plan entry (the fused modules
folded into one per top-level block, planned once per cldm module: hosts/comfyui/object_patches.py). ComfyUI sets the
patches when it loads that patcher for sampling and restores the original modules when it unloads it or
loads another clone (stock ControlNet, another prompt). `cn` itself, its patcher and its cldm module are
never modified. (The copy is needed on both versions: 2024's `copy()` builds a fresh patcher, and
current ComfyUI's `copy()` shares the patcher, so patching it would leak into every copy.)

Chains: `previous_controlnet` links are copied and re-linked bottom-up; a link that is not ComfyUI's own
full ControlNet (T2I adapter, control-LoRA, other packs' classes) is not patched; a stock ComfyUI class
is copied so the chain can be re-linked, another pack's class keeps the chain above it stock.
Identity matters: ComfyUI batches cond and uncond together only when both carry the SAME control object,
so every ControlNet found in the conds is converted once and the copy is shared wherever it appeared.

Cond only (`ControlNetOptions.cond_only`, off by default, LOSSY): hosts/comfyui/controlnet_cond_only.py.

Entry points are used by Accelerated KSampler: `accelerate_conds(positive, negative, options)` before
sampling and `release(info)` after it (drops the cached hint features).
"""
import logging
from dataclasses import dataclass

from ...engine.options import AccelOptions
from ...engine.patches import hint_cache
from ...engine.graphs.graphed_forward import GraphedForward
from . import control_graph
from . import graphs_on_unload
from . import host_casts
from .controlnet_cond_only import set_cond_only
from . import object_patches
from . import restore_order
from . import stock_blocks
from . import union_control_type

log = logging.getLogger("sd_accel")


@dataclass(frozen=True)
class ControlNetOptions(AccelOptions):
    cuda_graph: bool = False
    channels_last: bool = False
    hint_cache: bool = True
    cond_only: bool = False   # lossy, opt-in: the ControlNets skip the uncond rows (see the module doc)
    # the chain runs inside the UNet's CUDA graph (hosts/comfyui/control_graph.py); only where the UNet's
    # step takes it (hosts/comfyui.runs_controlnets_in_graph), and not with cond_only
    one_graph: bool = False

    def any(self):
        return self.fused_kernels or self.hint_cache or self.cuda_graph or self.channels_last or self.cond_only


def _comfy_controlnet():
    import comfy.controlnet
    return comfy.controlnet


_PLANS_ATTR = "_sd_accel_cn_plans"


def plan_controlnet(patcher, options):
    """The engine's patch plan for the cldm ControlNet module of `patcher` (a clone of the ControlNet's own):
    (patches, counts). Never modifies the module. The fused and channels_last stand-ins, folded into one
    patch per top-level block (hosts/comfyui/object_patches.py), are planned once per module and options and
    kept on the module: a ControlNet's patcher is a new clone every prompt, and planning its ~90 stand-ins
    anew took ~4 ms per ControlNet and prompt on this CPU."""
    control_model = patcher.model
    patches, counts = {}, {}
    layout = options.channels_last and _runs_on_cuda()
    if options.fused_kernels or layout:
        plans = control_model.__dict__.setdefault(_PLANS_ATTR, {})
        foreign = object_patches.foreign_patches(patcher)
        key = (options.fused_kernels, layout, tuple(k for k, _ in foreign))
        hit = plans.get(key)
        if hit is None or any(a is not b for (_, a), (_, b) in zip(hit[2], foreign)):
            planned, planned_counts = object_patches.plan(patcher, options.fused_kernels, layout, root="")
            hit = plans[key] = (planned, planned_counts, foreign)
        patches.update(hit[0])
        counts.update(hit[1])
    if options.cuda_graph:
        typed = union_control_type.plan(control_model)
        patches.update(typed)
        if typed:
            counts["control_type_slice"] = 1
    if options.hint_cache and not options.cuda_graph:
        hc = hint_cache.plan_hint_cache(control_model)
        patches.update(hc)
        if hc:
            counts["hint_cache"] = len(hc)
    if options.cuda_graph or options.channels_last or options.fused_kernels:
        # without graphs too: its calls then take the faster of the fused and the stock modules, measured, as the
        # UNet's eager steps do (the fused ones launch more kernels, and a host-bound call pays for each)
        gf = GraphedForward.for_module(control_model, type(control_model).__name__,
                                       options.cuda_graph, options.channels_last)
        if gf.stock_tree is None:
            gf.stock_tree = stock_blocks.for_forward(gf)
        patches["forward"] = gf
        if options.cuda_graph or options.channels_last:
            counts["cuda_graph" if options.cuda_graph else "channels_last"] = 1
    return patches, counts


def _runs_on_cuda():
    """channels_last stand-ins only when ComfyUI runs its models on a GPU (CPU results stay stock's)."""
    import comfy.model_management as mm
    return getattr(mm.get_torch_device(), "type", None) == "cuda"


def _patchable(cn):
    """None if `cn` can be patched here, else why not."""
    cnm = _comfy_controlnet()
    if type(cn) is not cnm.ControlNet:
        return "%s is not a full ControlNet" % type(cn).__name__
    wrapped = getattr(cn, "control_model_wrapped", None)
    if getattr(cn, "control_model", None) is None or wrapped is None:
        return "no control model"
    if not (hasattr(wrapped, "clone") and hasattr(wrapped, "add_object_patch")):
        return "its model patcher has no object patches"
    return None


def _stock_copyable(cn):
    """A ComfyUI class whose own copy() we can rely on to re-link a chain (T2I adapter, control-LoRA)."""
    cls = type(cn)
    cnm = _comfy_controlnet()
    return cls.__module__ == cnm.__name__ and getattr(cnm, cls.__name__, None) is cls and hasattr(cn, "copy")


class _Converter:
    def __init__(self, options):
        self.options = options
        self.memo = {}        # id(original) -> (original, converted)
        self.plans = {}       # id(cldm module) -> (module, patches, counts)
        self.info = {"controlnets": 0, "patched": {}, "skipped": [], "hint_caches": [], "forwards": []}
        if options.cond_only:
            self.info["cond_only"] = {"halved": 0, "uncond_skipped": 0, "no_info": 0}
            self.cond_only_depth = [0]   # calls of the chain in progress: only the outermost one counts
        elif options.one_graph:
            self.info["one_graph"] = control_graph.new_stats()
            self.epoch = object()   # one sampling run: the ControlNets' weights are walked once for it

    def plan(self, patcher):
        hit = self.plans.get(id(patcher.model))
        if hit is None:
            patches, counts = plan_controlnet(patcher, self.options)
            hit = self.plans[id(patcher.model)] = (patcher.model, patches, counts)
            self.info["hint_caches"] += hint_cache.caches_in(patches.values())
            for gf in patches.values():
                if isinstance(gf, GraphedForward):
                    gf.new_run()
                    self.info["forwards"].append(gf)
            for op, n in counts.items():
                self.info["patched"][op] = self.info["patched"].get(op, 0) + n
        return hit[1]

    def convert(self, cn):
        if cn is None:
            return None
        hit = self.memo.get(id(cn))
        if hit is not None:
            return hit[1]
        prev = getattr(cn, "previous_controlnet", None)
        new_prev = self.convert(prev)
        why = _patchable(cn)
        if why is None:
            new = cn.copy()
            patcher = cn.control_model_wrapped.clone()
            patches = self.plan(patcher)
            for path, module in patches.items():
                patcher.add_object_patch(path, module)
            restore_order.keep_restore_order(patcher, patches)
            new.control_model_wrapped = patcher
            if not graphs_on_unload.free_graphs_on_unload(patcher, patches):
                self.info["stock_layout_after_run"] = True   # no ON_DETACH to do it: release() does
            new.set_previous_controlnet(new_prev)
            if self.options.cond_only:
                set_cond_only(new, self.info["cond_only"], self.cond_only_depth)
            elif self.options.one_graph:
                control_graph.install(new, self.info["one_graph"], self.epoch)
            self.info["controlnets"] += 1
        else:
            self.info["skipped"].append(why)
            if new_prev is prev:
                new = cn
            elif _stock_copyable(cn):
                new = cn.copy()
                new.set_previous_controlnet(new_prev)
            else:
                new = cn   # cannot re-link another pack's class: the chain below it stays stock here
                self.info["skipped"].append("chain below %s left stock" % type(cn).__name__)
        self.memo[id(cn)] = (cn, new)
        return new


def accelerate_controlnet(cn, options=ControlNetOptions()):
    """(patched copy of the ControlNet chain `cn`, info). `cn` is untouched; unpatchable links stay stock."""
    if not options.any():
        return cn, {"controlnets": 0, "patched": {}, "skipped": [], "hint_caches": []}
    if options.fused_kernels:
        host_casts.register()
    conv = _Converter(options)
    return conv.convert(cn), conv.info


def accelerate_conds(positive, negative, options=ControlNetOptions()):
    """New (positive, negative) lists whose "control" entries are patched copies; the inputs (ComfyUI's
    cached node outputs) are not modified. Also returns the info dict for `summary` and `release`."""
    conv = _Converter(options)
    if options.fused_kernels:
        host_casts.register()

    def convert(conds):
        if not options.any() or conds is None:
            return conds
        out = []
        for item in conds:
            d = item[1] if isinstance(item, (list, tuple)) and len(item) > 1 else None
            if isinstance(d, dict) and d.get("control") is not None:
                item = [item[0], dict(d, control=conv.convert(d["control"]))] + list(item[2:])
            out.append(item)
        return out
    return convert(positive), convert(negative), conv.info


def graph_stats(info):
    """Summed CUDA-graph counters of the ControlNets' stand-ins (since their models were loaded)."""
    out = {}
    for gf in {id(g.graphs): g.graphs for g in (info or {}).get("forwards", ())}.values():
        for k, v in gf.stats.items():
            out[k] = out.get(k, 0) + v
        out["stock_path"] = out.get("stock_path", 0) + gf.eager_paths.stock_calls
    return out


def hint_stats(info):
    hits = misses = 0
    for m in (info or {}).get("hint_caches", ()):
        s = m.sdaccel_stats()
        hits += s["hits"]
        misses += s["misses"]
    return {"hits": hits, "misses": misses}


def release(info):
    """After sampling: drops the cached hint features (nothing outlives the run). On a ComfyUI without ON_DETACH
    callbacks (2024) it also puts the ControlNets' conv weights back in stock's layout: they are the user's
    ControlNet's, which a stock Apply ControlNet runs next on whatever layout they are in, slower on channels_last.
    Current ComfyUI tells us when a stock node loads them (graphs_on_unload.free_graphs_on_unload). In place, so the
    graphs stay valid; the next accelerated run converts them again before its first capture or replay."""
    info = info or {}
    for m in info.get("hint_caches", ()):
        m.clear()
    if info.get("stock_layout_after_run"):
        for gf in info.get("forwards", ()):
            gf.to_stock_layout()


def summary(info):
    """One short line for the run report, or None when no ControlNet was found."""
    if not info or (not info["controlnets"] and not info["skipped"]):
        return None
    parts = ["controlnet: %d patched" % info["controlnets"]]
    if info["patched"]:
        parts.append(", ".join("%s x%d" % kv for kv in sorted(info["patched"].items())))
    hs = hint_stats(info)
    if hs["hits"] or hs["misses"]:
        parts.append("hint block computed %d, reused %d" % (hs["misses"], hs["hits"]))
    gs = dict(info.get("graph_delta") or {})
    stock_calls = gs.pop("stock_path", 0)
    if any(gs.values()):   # the ControlNets' own graphs (none when they run inside the UNet's)
        parts.append("graphs: %d replays, %d captures, %d eager" % (gs.get("replays", 0), gs.get("captures", 0),
                                                                  gs.get("eager", 0)))
    if stock_calls:
        parts.append("%d call%s on the stock modules (faster than the fused ones without a graph)"
                     % (stock_calls, "" if stock_calls == 1 else "s"))
    og = info.get("one_graph")
    if og is not None:
        part = "in the UNet's graph: %d calls" % og["deferred"]
        if og["stock"]:
            part += "; own graphs: %s" % ", ".join("%d (%s)" % (n, why) for why, n in sorted(og["stock"].items()))
        parts.append(part)
    cs = info.get("cond_only")
    if cs is not None:
        part = "cond only (lossy): uncond rows skipped in %d calls" % (cs["halved"] + cs["uncond_skipped"])
        if cs["no_info"]:
            part += ("; %d calls ran the full batch, lossless (this ComfyUI does not tell the ControlNet which "
                     "rows are cond)" % cs["no_info"])
        parts.append(part)
    if info["skipped"]:
        parts.append("left stock: " + "; ".join(sorted(set(info["skipped"]))))
    return "; ".join(parts)
