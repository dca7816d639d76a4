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
    ControlNet stay outside, in ComfyUI's own code, so they are honoured on every step;
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

Cond only (`ControlNetOptions.cond_only`, off by default, LOSSY): ComfyUI runs cond and uncond in one
batch when both carry the same control object, and `ControlNet.get_control` runs the ControlNet on the
whole batch. With this option our copy gets an instance attribute `get_control` (the class's own method
is not touched; `del copy.get_control` undoes it) that reads `transformer_options["cond_or_uncond"]`,
calls the class's get_control on the cond rows only (x, t and the per-row conds sliced, the hint
broadcast to those rows by ComfyUI's own code) and gives the uncond rows zero residuals, i.e. nothing
added: half the ControlNet work under CFG, and a different image (the negative prediction no longer sees
the control). Rows decide, not the list a control came from: a batch of uncond rows only (a negative with
its own control object) gets no control at all. Previous links of the chain run inside that call, so on
the cond rows as well. Where ComfyUI does not say which rows are cond (2024's get_control has no
transformer_options) the full batch runs, lossless, and the report says so. A half batch is another
input shape, so with CUDA graphs on it simply gets its own graph.

Entry points are used by Accelerated KSampler: `accelerate_conds(positive, negative, options)` before
sampling and `release(info)` after it (drops the cached hint features).
"""
import logging
import types
from dataclasses import dataclass

from ...engine.options import AccelOptions
from ...engine.patches import hint_cache
from ...engine.graphs.graphed_forward import GraphedForward
from . import control_graph
from . import object_patches

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


def _register_weight_caster():
    from . import accelerate as comfyui
    comfyui._register_weight_caster()


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
    if options.hint_cache and not options.cuda_graph:
        hc = hint_cache.plan_hint_cache(control_model)
        patches.update(hc)
        if hc:
            counts["hint_cache"] = len(hc)
    if options.cuda_graph or options.channels_last:
        gf = GraphedForward.for_module(control_model, type(control_model).__name__,
                                       options.cuda_graph, options.channels_last)
        patches["forward"] = gf
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
            object_patches.keep_restore_order(patcher, patches)
            new.control_model_wrapped = patcher
            _free_graphs_on_unload(patcher, patches)
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


COND, UNCOND = 0, 1   # comfy.samplers' labels in cond_or_uncond


def set_cond_only(cn, stats, depth=None):
    """Cond-only mode on `cn`, a copy of ours (never a ControlNet the user's graph holds): an instance
    attribute over the class's get_control. `del cn.get_control` removes it. `stats` counts the calls
    (the links of one chain share it and `depth`, so a chain's call counts once)."""
    cn._sdaccel_cond_only = (stats, depth if depth is not None else [0])
    cn.get_control = types.MethodType(_cond_only_get_control, cn)


def _cond_spans(batch, cond_or_uncond):
    """(row spans of the cond chunks, number of cond chunks, number of chunks), or None when unknown."""
    if not isinstance(cond_or_uncond, (list, tuple)) or not cond_or_uncond or batch % len(cond_or_uncond):
        return None
    per = batch // len(cond_or_uncond)
    spans = []
    for i, label in enumerate(cond_or_uncond):
        if label != COND:
            continue
        if spans and spans[-1][1] == i * per:
            spans[-1] = (spans[-1][0], (i + 1) * per)
        else:
            spans.append((i * per, (i + 1) * per))
    return spans, sum(1 for v in cond_or_uncond if v == COND), len(cond_or_uncond)


def _take_rows(v, spans, batch):
    import torch
    if not isinstance(v, torch.Tensor) or v.ndim == 0 or v.shape[0] != batch:
        return v
    if len(spans) == 1:
        return v[spans[0][0]:spans[0][1]]
    return torch.cat([v[a:b] for a, b in spans])


def _pad_rows(control, spans, batch):
    """The residuals of the cond rows back at their rows of the full batch; zeros on the uncond rows."""
    import torch
    n = sum(b - a for a, b in spans)
    padded = {}   # id -> padded tensor: a tensor shared between entries stays shared

    def pad(x):
        if not isinstance(x, torch.Tensor) or x.ndim == 0 or x.shape[0] != n:
            return x
        hit = padded.get(id(x))
        if hit is None:
            hit = x.new_zeros((batch,) + tuple(x.shape[1:]))
            o = 0
            for a, b in spans:
                hit[a:b] = x[o:o + b - a]
                o += b - a
            padded[id(x)] = hit
        return hit
    return {k: [pad(x) for x in v] if isinstance(v, list) else v for k, v in control.items()}


def _cond_only_get_control(self, x_noisy, t, cond, batched_number, *args, **kwargs):
    stats, depth = self._sdaccel_cond_only
    depth[0] += 1
    try:
        return _cond_only(self, stats, depth[0] == 1, x_noisy, t, cond, batched_number, *args, **kwargs)
    finally:
        depth[0] -= 1


def _cond_only(self, stats, outermost, x_noisy, t, cond, batched_number, *args, **kwargs):
    stock = type(self).get_control
    to = args[0] if args else kwargs.get("transformer_options", cond.get("transformer_options"))
    rows = _cond_spans(x_noisy.shape[0], (to or {}).get("cond_or_uncond"))
    if rows is None:
        stats["no_info"] += outermost
        return stock(self, x_noisy, t, cond, batched_number, *args, **kwargs)
    spans, n_cond, n_chunks = rows
    if n_cond == n_chunks:
        return stock(self, x_noisy, t, cond, batched_number, *args, **kwargs)
    if n_cond == 0:
        stats["uncond_skipped"] += 1
        return None
    stats["halved"] += 1
    batch = x_noisy.shape[0]
    to2 = dict(to, cond_or_uncond=[COND] * n_cond)
    uuids = to.get("uuids")
    if isinstance(uuids, (list, tuple)) and len(uuids) == n_chunks:
        to2["uuids"] = [u for u, label in zip(uuids, to["cond_or_uncond"]) if label == COND]
    cond2 = {k: _take_rows(v, spans, batch) for k, v in cond.items()}
    if "transformer_options" in cond2:
        cond2["transformer_options"] = to2
    if args:
        args = (to2,) + tuple(args[1:])
    else:
        kwargs = dict(kwargs, transformer_options=to2)
    out = stock(self, _take_rows(x_noisy, spans, batch), _take_rows(t, spans, batch), cond2, n_cond, *args, **kwargs)
    return None if out is None else _pad_rows(out, spans, batch)


def _free_graphs_on_unload(patcher, patches):
    """Current ComfyUI: when it detaches the ControlNet's patcher and the weights left the GPU, free the
    graph memory (older ComfyUI has no callbacks: the graphs go when the weights change or the model dies)."""
    forwards = [gf for gf in patches.values() if isinstance(gf, GraphedForward)]
    if not forwards or not hasattr(patcher, "add_callback_with_key"):
        return
    import comfy.patcher_extension as pe

    def on_detach(p, unpatch_all=True, _forwards=tuple(forwards)):
        for gf in _forwards:
            gf.graphs.clear_if_offloaded()
    patcher.add_callback_with_key(pe.CallbacksMP.ON_DETACH, "sd_accel", on_detach)


def accelerate_controlnet(cn, options=ControlNetOptions()):
    """(patched copy of the ControlNet chain `cn`, info). `cn` is untouched; unpatchable links stay stock."""
    if not options.any():
        return cn, {"controlnets": 0, "patched": {}, "skipped": [], "hint_caches": []}
    if options.fused_kernels:
        _register_weight_caster()
    conv = _Converter(options)
    return conv.convert(cn), conv.info


def accelerate_conds(positive, negative, options=ControlNetOptions()):
    """New (positive, negative) lists whose "control" entries are patched copies; the inputs (ComfyUI's
    cached node outputs) are not modified. Also returns the info dict for `summary` and `release`."""
    conv = _Converter(options)
    if options.fused_kernels:
        _register_weight_caster()

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
    return out


def hint_stats(info):
    hits = misses = 0
    for m in (info or {}).get("hint_caches", ()):
        s = m.sdaccel_stats
        hits += s["hits"]
        misses += s["misses"]
    return {"hits": hits, "misses": misses}


def release(info):
    """Drops the cached hint features (call after sampling): nothing outlives the run."""
    for m in (info or {}).get("hint_caches", ()):
        m.clear()


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
    gs = info.get("graph_delta")
    if gs and any(gs.values()):   # the ControlNets' own graphs (none when they run inside the UNet's)
        parts.append("graphs: %d replays, %d captures, %d eager" % (gs.get("replays", 0), gs.get("captures", 0),
                                                                  gs.get("eager", 0)))
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
