"""ComfyUI host, VAE side: the fused modules, channels_last and CUDA graphs on a copy of a VAE, ComfyUI's way.

ComfyUI's VAE (comfy.sd.VAE, 2024-03 and current) holds its model, `first_stage_model`, in a ModelPatcher
(`vae.patcher`); its `decode`, `decode_tiled`, `encode` and `encode_tiled` load that patcher with
`load_models_gpu` and then call `first_stage_model.decode` / `.encode` (once, in a loop of batches, or per
tile). `accelerate_vae(vae, options)` returns a shallow copy of the VAE object whose `patcher` is a `clone()` of
the VAE's own, with one `add_object_patch(path, module)` per entry of the plan:
  * every eligible ResnetBlock of the encoder and decoder -> the stand-in of engine/patches/fused_vae.py, every
    other GroupNorm -> a fused GroupNorm (the same Parameter objects under the same names);
  * `decoder.forward` and `encoder.forward` -> GraphedForward (engine/graphs/graphed_forward.py): each call
    replayed from a CUDA graph per shape (a tiled decode's tiles are calls too), the conv weights converted to
    channels_last (in place, values unchanged) before the first GPU call. The 1x1 quant convs and the latent
    distribution stay outside, in ComfyUI's code (ComfyUI 2024 samples the latent with host random numbers,
    which no graph can hold).
ComfyUI sets the patches when it loads the clone and restores the original modules when it loads another clone
of the same model (the user's VAE in a stock VAE Decode) or unloads it, as for a UNet's clone. The copy's own
methods are the VAE's: ComfyUI's memory estimates, batching and its tiled retry after an out-of-memory error
all run unchanged on the accelerated modules. The user's VAE object, its patcher's patches and its modules are
never modified (the conv weights' layout aside: channels_last during each decode or encode of the copy, back in
stock's when it returns, and channels_last only on a ComfyUI with ON_DETACH callbacks); the copies are cached per
VAE and options on its patcher.
Not folded per block (hosts/comfyui/object_patches.py): a VAE is not sampled, so no callback keeps our blocks
last in ComfyUI's restore order, and its ~60 swaps per load cost about a millisecond.

A graph keeps its working memory between calls, and a 1024² decode's is GiBs, so it must be memory ComfyUI sees
and memory that goes when the VAE does (engine/graphs/graph_memory.py). A call replays only
  * under cudaMallocAsync (ComfyUI's default): a graph's memory is then the driver's, which ComfyUI's
    `get_free_memory` counts as used (torch's native allocator keeps it in a pool ComfyUI would count as free);
  * on a ComfyUI with ON_DETACH callbacks: when ComfyUI unloads the VAE (to make room for another model, or a
    Free memory node) the graphs are dropped and their memory trimmed back to the device;
  * where ComfyUI's own estimate of the call's memory (per image, times the batch) is at most `GRAPH_SHARE` of the
    GPU, and no budget is in force.
Other calls run eagerly on the faster of the fused and the stock modules. Falls back, with one
reason each in `info["reasons"]`: a VAE off CUDA runs its own modules (bit for bit stock; only the kernels'
interpreter with SDACCEL_EAGER_PATH=fused takes the fused path on the CPU, for tests), no Triton or an old GPU
leaves the kernels out, a model that is not an image AutoencoderKL (video, audio, TAESD) is returned as it is.
"""
import contextlib
import copy
import logging
import weakref
from dataclasses import dataclass

import torch

from ...engine.graphs import eager, graph_memory
from ...engine.graphs.graphed_forward import GraphedForward, Policy
from ...engine.options import AccelOptions
from ...engine.patches import fused_vae
from ...engine.reports import kernel_report
from ...kernels import _triton
from . import accelerate
from . import conv_layout
from . import graphs_on_unload
from . import host_casts
from . import object_patches

log = logging.getLogger("sd_accel")
GIB = 2 ** 30
GRAPH_SHARE = 1 / 8     # most of the GPU's memory one call's graph may keep reserved
# ComfyUI's tiled decode runs three tilings (tall, wide, square tiles), each with its own edge tiles: up to 18
# shapes for one image at its default tile sizes; past the bound every graph would be captured again
MAX_SHAPES = 24
_COPIES_ATTR = "_sd_accel_vae_copies"
_ORIGINAL = "_sd_accel_vae_of"
_MODELS = ("AutoencoderKL", "AutoencodingEngineLegacy", "AutoencodingEngine")
_MODEL_FILE = "comfy.ldm.modules.diffusionmodules.model"


@dataclass(frozen=True)
class VAEOptions(AccelOptions):
    def any(self):
        return self.fused_kernels or self.cuda_graph or self.channels_last


def original_of(vae):
    """The user's VAE an accelerated copy was made from (`vae` itself for any other)."""
    ref = getattr(vae, "__dict__", {}).get(_ORIGINAL)
    found = ref() if ref is not None else None
    return found if found is not None else vae


def accelerate_vae(vae, options=VAEOptions()):
    """(accelerated copy of `vae`, info); `vae` itself where nothing applies. Cached per VAE and options."""
    vae = original_of(vae)
    patcher = getattr(vae, "patcher", None)
    copies = patcher.__dict__.setdefault(_COPIES_ATTR, {}) if patcher is not None else {}
    key = (options, _forced_fused())
    hit = copies.get(key)
    fresh = hit is not None and hit[2] == getattr(patcher, "patches_uuid", None) and hit[3]() is vae
    if patcher is not None:
        old = getattr(hit[0], "patcher", None) if hit is not None and not fresh else None
        accelerate.keep_while_loaded(patcher, old if old is not patcher else None)
    if fresh:
        return (vae if hit[0] is None else hit[0]), hit[1]
    acc, info = _accelerate(vae, options)
    if patcher is not None:
        # the VAE itself where nothing applies (CPU, options off) is cached as None: the cache lives on its
        # patcher, and a reference to the VAE there would be a cycle that keeps a dropped VAE until a collection
        copies[key] = (None if acc is vae else acc, info, getattr(patcher, "patches_uuid", None), weakref.ref(vae))
    return acc, info


def _forced_fused():
    """The kernels' interpreter asked for the fused path (SDACCEL_EAGER_PATH=fused, TRITON_INTERPRET=1): tests."""
    return eager.FORCED_PATH == "fused" and _triton.interpret_mode()


def _accelerate(vae, options):
    info = {"options": options.__dict__.copy(), "patched": {}, "reasons": {}, "forwards": {}}
    why = _stock_reason(vae, options)
    if why:
        info["reasons"]["SD Accel"] = why
        return vae, info
    host_casts.register()
    clone = vae.patcher.clone()
    accelerate.parent_beyond_the_cache(clone, vae.patcher)   # the copies are cached on vae.patcher
    patches, counts = {}, {}
    if options.fused_kernels:
        why = _kernels_reason(vae) or object_patches.foreign_modules_reason(clone, root="")
        if why:
            info["reasons"]["fused kernels"] = why
        else:
            patches, counts = object_patches.plan(clone, True, False, root="", fold=False, planner=_planner)
    channels_last = options.channels_last and _half_precision(vae)
    if options.channels_last and not channels_last:
        info["reasons"]["channels_last"] = ("a %s VAE keeps stock's layout (NHWC convolutions are kept for fp16 and "
                                            "bf16, where cuDNN runs them on tensor cores)"
                                            % str(getattr(vae, "vae_dtype", "")).replace("torch.", ""))
    elif channels_last and not graphs_on_unload.calls_on_detach(clone):
        channels_last = False   # the weights are the user's VAE's: a stock VAE Decode after ours runs on them
        info["reasons"]["channels_last"] = ("this ComfyUI has no ON_DETACH callbacks, which would put the conv "
                                            "weights back in stock's layout for a stock VAE Decode after ours")
    if options.cuda_graph or channels_last:
        no_graphs = _no_graphs_reason(clone) if options.cuda_graph else None
        if no_graphs:
            info["reasons"]["cuda_graph"] = no_graphs
        for method, coder, estimate in (("decode", "decoder", vae.memory_used_decode),
                                        ("encode", "encoder", vae.memory_used_encode)):
            # GPU-bound with or without graphs: the fused modules measured faster without graphs too (bench_vae)
            policy = Policy(refuse=_graph_memory_rule(method, estimate, no_graphs), max_graphs=MAX_SHAPES,
                            layout_first_call=True, fused_without_graphs=True)
            module = getattr(clone.model, coder)
            gf = info["forwards"][method] = GraphedForward(module, "VAE " + coder, options.cuda_graph,
                                                           channels_last, policy)
            patches[coder + ".forward"] = gf
    for path, module in patches.items():
        clone.add_object_patch(path, module)
    graphs_on_unload.free_graphs_on_unload(clone, patches)
    acc = copy.copy(vae)
    acc.patcher = clone
    acc.__dict__[_ORIGINAL] = weakref.ref(vae)
    if channels_last:
        conv_layout.stock_layout_between_calls(acc, list(info["forwards"].values()))
    info["patched"] = counts
    info["object_patches"] = len(patches)
    return acc, info


def _planner(view, prefix, live):
    p = fused_vae.plan_vae(view, prefix)
    return p.patches, p.counts


def _stock_reason(vae, options):
    """Why the VAE keeps its own modules altogether, or None."""
    if not options.any():
        return "all options off"
    model = getattr(vae, "first_stage_model", None)
    if getattr(vae, "patcher", None) is None or getattr(vae.patcher, "model", None) is not model:
        return "this VAE holds no ModelPatcher of its model"
    if type(model).__name__ not in _MODELS or not all(_image_coder(getattr(model, n, None))
                                                      for n in ("encoder", "decoder")):
        return "%s is not an image AutoencoderKL (SD, SDXL, SD3, Flux VAEs)" % type(model).__name__
    device = torch.device(vae.device)
    if device.type != "cuda" and not _forced_fused():
        return ("VAE on %s: its own modules run (fused kernels, channels_last and CUDA graphs need a CUDA GPU)"
                % device.type)
    return None


def _half_precision(vae):
    return getattr(vae, "vae_dtype", None) in (torch.float16, torch.bfloat16)


def _image_coder(m):
    conv = getattr(m, "conv_in", None)
    return type(m).__module__ == _MODEL_FILE and isinstance(conv, torch.nn.Conv2d)


def _kernels_reason(vae):
    ok, why = _triton.triton_runnable(torch.empty(0, device=vae.device))
    return None if ok else why


def _no_graphs_reason(clone):
    """Why no VAE call may keep a graph on this ComfyUI, or None."""
    return graphs_on_unload.no_detach_reason(clone, "VAE")


def _graph_memory_rule(method, estimate, no_graphs=None):
    """GraphedForward's refusal for `method`'s calls: `no_graphs`, else `graph_memory_refusal` of ComfyUI's
    estimate for the call (ComfyUI's image VAE estimates are per image: times the batch)."""
    def refuse(args, kwargs):
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or not x.is_cuda:
            return None
        if no_graphs:
            return no_graphs
        if not graph_memory.async_allocator():
            return ("torch's native allocator (--disable-cuda-malloc): a graph's pool would count as free memory "
                    "in ComfyUI's get_free_memory")
        need = estimate(tuple(x.shape), x.dtype) * max(1, x.shape[0])
        return graph_memory_refusal(method, need, _total_memory(x.device), eager.budgeted())
    return refuse


def graph_memory_refusal(method, need, total, budgeted):
    """Why a call needing `need` bytes may not keep a graph on a GPU of `total` bytes, or None."""
    if budgeted:
        return "a memory budget is in force (a graph's memory would stay reserved past the call)"
    if need > total * GRAPH_SHARE:
        return ("a %s of this size keeps ~%.1f GiB reserved as a graph (over 1/%d of the GPU's %.0f GiB)"
                % (method, need / GIB, round(1 / GRAPH_SHARE), total / GIB))
    return None


def _total_memory(device):
    return torch.cuda.get_device_properties(device).total_memory


def patched_line(info):
    """One line of what `accelerate_vae` put on the copy, e.g. "patched: group_norm x4, vae_resnet_block x10 |
    decode, encode: a CUDA graph per shape, channels_last | fell back: ..."."""
    parts = ["patched: %s" % (", ".join("%s x%d" % kv for kv in sorted(info["patched"].items())) or "nothing")]
    opts = info["options"]
    how = [w for w, on in (("a CUDA graph per shape", opts.get("cuda_graph") and "cuda_graph" not in info["reasons"]),
                           ("channels_last", opts.get("channels_last") and "channels_last" not in info["reasons"]))
           if on]
    if info["forwards"] and how:
        parts.append("%s: %s" % (", ".join(sorted(info["forwards"])), ", ".join(how)))
    if info["reasons"]:
        parts.append("fell back: " + "; ".join("%s: %s" % kv for kv in info["reasons"].items()))
    return " | ".join(parts)


# -- what one call ran ----------------------------------------------------------------------------------

def counters(info):
    """What the call about to run is measured against (`report`)."""
    graphs = {m: (dict(gf.graphs.stats), dict(gf.graphs.refused), gf.graphs.eager_paths.stock_calls,
                  gf.channels_last_calls)
              for m, gf in info["forwards"].items()}
    return kernel_report.snapshot(), graphs


@contextlib.contextmanager
def measured(info, out):
    """Runs the block as one accelerated VAE call; `out` (a dict) gets its report (`report`) after it."""
    before = counters(info)
    yield
    out.update(report(info, before))


def report(info, before):
    """{"ran": [...], "fell_back": {what: why}, "line": one line} of the calls since `before` (`counters`)."""
    k0, g0 = before
    kernels = kernel_report.summarize(k0, kernel_report.snapshot())
    ran, fell_back = [], dict(info["reasons"])
    fused = sum(e["fused"] for e in kernels.values())
    if fused:
        ran.append("fused kernels x%d" % fused)
    for op, e in sorted(kernels.items()):
        if e["fallback"]:
            fell_back[op] = "; ".join(e["reasons"]) or "not eligible"
    for method, gf in info["forwards"].items():
        _graph_report(method, gf, g0.get(method), ran, fell_back)
    opts = info["options"]
    for k in ("fused_kernels", "cuda_graph", "channels_last"):
        if not opts.get(k):
            fell_back.setdefault(k, "off")
    line = "ran: %s | fell back: %s" % (", ".join(ran) or "stock modules only",
                                        "; ".join("%s: %s" % kv for kv in fell_back.items()) or "nothing")
    return {"ran": ran, "fell_back": fell_back, "line": line}


def _graph_report(method, gf, before, ran, fell_back):
    stats0, refused0, stock0, layout0 = before or ({}, {}, 0, 0)
    g = gf.graphs
    calls = {k: v - stats0.get(k, 0) for k, v in g.stats.items()}
    if gf.channels_last and gf.channels_last_calls > layout0:   # counted by every call, graphs off too
        ran.append("channels_last (%s)" % method)
    if not (calls["replays"] or calls["eager"]):
        return    # no graph ran or was refused for this method: graphs off, or the method was not called
    if calls["replays"]:
        ran.append("cuda_graph %s (%d replays, %d captures)" % (method, calls["replays"], calls["captures"]))
    refused = {r: n - refused0.get(r, 0) for r, n in g.refused.items() if n > refused0.get(r, 0)}
    if gf.cuda_graph and calls["eager"]:
        why = "; ".join("%s (%d)" % kv for kv in refused.items()) or g.last_eager_reason or "eager"
        fell_back["cuda_graph %s (%d eager)" % (method, calls["eager"])] = why
    stock = g.eager_paths.stock_calls - stock0
    if stock:
        fell_back["fused kernels (%s)" % method] = ("%d call%s ran the stock modules: faster where no graph runs"
                                                    % (stock, "" if stock == 1 else "s"))
