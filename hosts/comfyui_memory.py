"""ComfyUI host, memory side: what the VRAM Pool node (nodes/memory_nodes.py) sets up for the sampling runs of
one model, through ComfyUI's own model_management (its loader sees the budget and partially loads the model
the way --lowvram does).

What is wired now, and how (the VAE decode under a budget is the separate VAE Decode (SD Accel) node, nodes/vae_nodes.py):
- budget_gib: checked against the model before sampling (engine/vram_plan.py); during each sampling run of
  the returned model, `comfy.model_management.EXTRA_RESERVED_VRAM` is raised so the loader sees only the
  budget of the card, and restored afterwards. Needs a ComfyUI with keyed sampler wrappers and
  EXTRA_RESERVED_VRAM (0.3.x); on older ComfyUI the node says the budget is not enforced.
- offload=medvram: before sampling every other model is unloaded from the GPU, after sampling the model.
- offload=lowvram: ComfyUI partially loads the UNet under the budget minus the planner's streaming ring;
  once it has (a SAMPLER_SAMPLE wrapper, inside the run), what it left on the CPU is streamed unit by unit
  (vram_plan.stream_units) into fixed places of a GPU ring (engine/offload.py, one copy per unit, prefetch on a
  side stream) instead of being copied layer by layer at every use. Its cast path (`comfy_cast_weights`) then finds the weight
  already on the GPU and does not copy. Fixed places let the Accelerated KSampler's CUDA graphs capture the
  copies with the step. Removed after the run, on error too. CUDA only; elsewhere the run is offload=none
  and the notes say so.
- out of memory during a run: memory is freed and the run retried once with more offload (lowvram where it
  can run, and half the budget); a second one is an error naming the budget and what to change.
- host copies (offload medvram or lowvram, CUDA): before each run, the pooled model and every model ComfyUI
  has loaded on its device (text encoders, VAE) are mirrored (engine/host_mirror.py): ComfyUI's moves off
  the GPU then point the weights back at pinned host copies instead of copying them out, and its moves to
  the GPU read from pinned memory. The models keep their copies (host memory of their size) while loaded.
- clip (optional): the pool's clip output encodes under the same budget, measured as the "text encode" stage;
  the next sampling run's report starts with it (pool_clip). The Accelerated KSampler shows that report.
- release_cache=after_run: the allocator's cached blocks are released after sampling (soft_empty_cache).
- expandable_segments: the CUDA allocator uses expandable segments during sampling (torch >= 2.1).
"""
import contextlib
import logging
import os

import torch

from ..engine import host_mirror, offload as block_offload, vram_plan, vram_report
from ..engine.graphs import eager
from ..kernels.errors import first_line

log = logging.getLogger("sd_accel")

GIB = 2 ** 30
WRAPPER_KEY = "sd_accel_vram_pool"
PREFETCH_DEPTH = 1
PROMOTE_MARGIN = 0.05    # of the budget, kept free of promoted blocks: ComfyUI's activation estimate is rough
# ComfyUI's activation estimate for the run's shape, times this, is what the placement keeps free. Device run 38:
# SDXL 1024² at 4 GiB peaked 0.29 GiB above an estimate of 0.64 GiB (with stream units the promoted weights
# fill the room up to the margin; with whole blocks the room had been left partly empty)
ACTIVATION_SAFETY = 1.5
OFFLOAD = ("none", "medvram", "lowvram")
RELEASE = ("never", "after_run")


def _mm():
    import comfy.model_management as mm
    return mm


def activation_bytes(mm):
    """What ComfyUI itself keeps free for a step besides weights (its minimum inference memory without the
    user's extra reserve): 0.8 GiB on ComfyUI 0.3.x, 1 GiB on 2024 versions."""
    extra = mm.extra_reserved_memory() if hasattr(mm, "extra_reserved_memory") else 0
    return int(mm.minimum_inference_memory() - extra)


def activation_estimate(mm, model):
    """The planner's activation bytes: ComfyUI's own estimate for this model (BaseModel.memory_required) at its
    native size (latent 64², SDXL-type models 128²), CFG batch 2, capped at ComfyUI's minimum inference
    reserve (the estimate without flash/xformers attention, e.g. on CPU, is far above it)."""
    reserve = activation_bytes(mm)
    try:
        bm = model.model
        lat = 128 if bm.model_config.unet_config.get("adm_in_channels") else 64
        return int(min(reserve, bm.memory_required([2, 4, lat, lat])))
    except Exception:  # noqa: BLE001 - an unusual model class: ComfyUI's reserve
        return reserve


def diffusion_model(model):
    """The ModelPatcher's diffusion model (get_model_object on ComfyUI 0.3.x, the attribute on 2024)."""
    if hasattr(model, "get_model_object"):
        return model.get_model_object("diffusion_model")
    return model.model.diffusion_model


def budget_supported(mm, model=None):
    """None when the host can enforce a budget on this model (any model: None), else why not."""
    if not hasattr(mm, "EXTRA_RESERVED_VRAM") or not hasattr(mm, "extra_reserved_memory"):
        return "this ComfyUI has no EXTRA_RESERVED_VRAM (update ComfyUI to 0.3.x)"
    if model is None:
        return None
    if not hasattr(model, "add_wrapper_with_key"):
        return "this ComfyUI has no keyed sampler wrappers (update ComfyUI to 0.3.x)"
    return None


@contextlib.contextmanager
def budget_scope(mm, budget_bytes, total_bytes):
    """Raise EXTRA_RESERVED_VRAM so ComfyUI's loader sees at most `budget_bytes` of a card of `total_bytes`;
    restored on exit, whatever happens. Never lowers the user's own --reserve-vram."""
    old = mm.EXTRA_RESERVED_VRAM
    mm.EXTRA_RESERVED_VRAM = max(old, int(total_bytes) - int(budget_bytes))
    try:
        yield mm.EXTRA_RESERVED_VRAM
    finally:
        mm.EXTRA_RESERVED_VRAM = old


@contextlib.contextmanager
def expandable_segments_scope(device, notes):
    """Expandable segments for the CUDA allocator inside the scope, when the torch build can switch them."""
    setter = getattr(getattr(torch.cuda, "memory", None), "_set_allocator_settings", None)
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if device.type != "cuda":
        notes.append("expandable_segments: off (%s run)" % device.type)
        yield
        return
    if "expandable_segments:True" in conf:
        notes.append("expandable_segments: already on (PYTORCH_CUDA_ALLOC_CONF)")
        yield
        return
    if setter is None:
        notes.append("expandable_segments: off (this torch %s cannot switch it)" % torch.__version__)
        yield
        return
    try:
        setter("expandable_segments:True")
    except Exception as e:  # noqa: BLE001 - a build without the feature must not stop sampling
        notes.append("expandable_segments: off (%s)" % e)
        yield
        return
    notes.append("expandable_segments: on")
    try:
        yield
    finally:
        setter("expandable_segments:False")


def mirror_models(mm, patcher, device):
    """Arms the host mirror on the pooled model and on every model ComfyUI has loaded on `device` (the ones
    that take turns with it in the budget). Returns a note."""
    if device.type != "cuda":
        return "host copies: off (the model runs on %s)" % device.type
    host_mirror.release_freed()
    modules = [getattr(patcher, "model", None)]
    for lm in mm.current_loaded_models:
        if getattr(lm, "device", None) == device:
            modules.append(getattr(getattr(lm, "model", None), "model", None))
    modules = list({id(m): m for m in modules if isinstance(m, torch.nn.Module)}.values())
    mirrors = [host_mirror.arm(m) for m in modules]
    held = sum(m.host_bytes() for m in mirrors)
    reused = sum(m.stats["reused_bytes"] for m in mirrors)
    return "host copies: %d models mirrored (%.2f GiB held; %.2f GiB of moves off the GPU so far without a copy)" % (
        len(mirrors), held / GIB, reused / GIB)


def _unload_others(mm, patcher, device):
    keep = [lm for lm in mm.current_loaded_models if lm.model is patcher]
    mm.free_memory(1e30, device, keep_loaded=keep)


class PoolSettings:
    def __init__(self, budget_bytes, offload, release_cache, expandable_segments, plan):
        self.budget_bytes, self.offload, self.release_cache = budget_bytes, offload, release_cache
        self.expandable_segments, self.plan = expandable_segments, plan
        self.last_report, self.last_notes = None, []
        self.text_stage = None        # the "text encode" stage of the pool's CLIP (pool_clip): its largest since
        self.text_notes = []          # the last sampling run, joined to that run's report
        self.active = None            # during a run: {"offload", "budget", "notes"} of the current attempt
        self.pinned_cache = {}        # pinned host copies of streamed weights, kept across runs
        self.promoted_cache = {}      # the same for the blocks moved to the GPU for the run (promoted)
        self.host_copies = True       # offload medvram/lowvram: mirror the models' weights in pinned host memory
        self.stream_every_block = False   # tests: stream every block, on a CPU device or where ComfyUI loaded it
        self.last_streamer = None


def _oom_types(mm):
    types_ = [torch.cuda.OutOfMemoryError]
    t = getattr(mm, "OOM_EXCEPTION", None)
    if isinstance(t, type) and t is not Exception and t not in types_:
        types_.append(t)
    return tuple(types_)


def streaming_unavailable(mm, patcher, device, settings=None):
    """None when lowvram block streaming can run for this model here, else why not."""
    why = budget_supported(mm, patcher)
    if why:
        return why
    if device.type != "cuda" and not (settings is not None and settings.stream_every_block):
        return "the model runs on %s, streaming needs a CUDA device" % device.type
    return None


def loader_budget(plan, budget, comfy_reserve=None):
    """The budget ComfyUI's loader is shown with lowvram streaming: the budget less the planner's streaming
    ring at that budget (where the streamed blocks take turns) and its activation estimate, plus the inference
    reserve the loader subtracts itself (`comfy_reserve`), so it loads the planner's resident bytes."""
    if plan is None or not budget:
        return budget
    try:
        p = vram_plan.plan_residency(list(plan.sizes.items()), budget, plan.activation_bytes, plan.prefetch_depth)
        window = p.peak_bytes - p.activation_bytes - p.resident_bytes
    except vram_plan.BudgetTooSmall:
        window = plan.min_budget_bytes - plan.activation_bytes
    reserve = plan.activation_bytes if comfy_reserve is None else comfy_reserve
    # ComfyUI keeps its own reserve (0.8 GiB) free of weights, more than an SD1.5 step needs besides the ring,
    # so it is shown that much more, but never more than the budget: shown more, it loaded the UNet's share
    # while the text encoders or the VAE were still there (device runs 38-39: SDXL at 4 GiB peaked at 4.09
    # GiB, with stream units whose small ring left the loader 4.16 GiB). What room it leaves is filled after
    # it loaded, from pinned buffers (_fit_and_streamed's promoted blocks)
    return min(max(budget - window - plan.activation_bytes + reserve, 0), budget)


def _attempt(settings, patcher, run, mm, total_bytes, device, offload, budget, report, stage, notes):
    with contextlib.ExitStack() as stack:
        stream = offload == "lowvram"
        if stream:
            why = streaming_unavailable(mm, patcher, device, settings)
            if why:
                notes.append("lowvram: off (%s); ran as offload=none" % why)
                stream = False
        if budget:
            if device.type == "cuda" or total_bytes is not None:
                total = total_bytes if total_bytes is not None else mm.get_total_memory(device)
                if budget >= total:
                    notes.append("budget %.2f GiB >= the card's %.2f GiB: no cap" % (budget / GIB, total / GIB))
                else:
                    # lowvram: ComfyUI's loader gets the budget less the streamed blocks in flight
                    reserve = activation_bytes(mm) if hasattr(mm, "minimum_inference_memory") else None
                    loader = loader_budget(settings.plan, budget, reserve) if stream else budget
                    stack.enter_context(budget_scope(mm, loader, total))
                    stack.enter_context(eager.under_vram_budget())
                    notes.append("budget %.2f GiB of %.2f GiB" % (budget / GIB, total / GIB)
                                 + (" (loader %.2f GiB, the rest for streaming)" % (loader / GIB) if stream else ""))
            else:
                notes.append("budget: not applied (the model runs on %s)" % device.type)
        if settings.expandable_segments:
            stack.enter_context(expandable_segments_scope(device, notes))
        if offload in ("medvram", "lowvram") and settings.host_copies:
            notes.append(mirror_models(mm, patcher, device))
        if offload == "medvram":
            if device.type == "cpu":
                notes.append("medvram: n/a (the model runs on cpu)")
            else:
                _unload_others(mm, patcher, device)
                notes.append("medvram: other models unloaded before, this one after")
        settings.active = {"offload": "lowvram" if stream else "none", "budget": budget, "notes": notes, "mm": mm}
        try:
            with report.stage(stage, device):
                return run()
        finally:
            settings.active = None
            if offload == "medvram" and device.type != "cpu":
                mm.free_memory(1e30, device)


def _more_offload(settings, mm, patcher, device, total_bytes):
    """(offload, budget) for the retry after an out-of-memory: lowvram where streaming can run (else medvram
    on a GPU), at half the budget (half the card when there was none), never below the planner's minimum."""
    offload = settings.offload
    if streaming_unavailable(mm, patcher, device, settings) is None:
        offload = "lowvram"
    elif device.type == "cuda":
        offload = "medvram"
    budget = settings.budget_bytes
    if device.type == "cuda" or total_bytes is not None:
        base = budget or (total_bytes if total_bytes is not None else mm.get_total_memory(device))
        floor = settings.plan.min_budget_bytes if settings.plan is not None else 0
        budget = max(int(base) // 2, floor)
    return offload, budget


def run_in_pool(settings, patcher, run, mm=None, total_bytes=None, before_retry=None):
    """Runs `run()` (one sampling run of `patcher`) under the pool's settings; ComfyUI's globals are restored
    on return or error. An out-of-memory is caught once: memory freed, `before_retry()` called, and `run()`
    called again with more offload (see _more_offload); a second one raises a RuntimeError that names the
    budgets. Records a MemoryReport ("sampling", "sampling (retry)") and notes on `settings`."""
    mm = mm or _mm()
    device = torch.device(patcher.load_device)
    notes, report = list(settings.text_notes), vram_report.MemoryReport()
    if settings.text_stage is not None:        # the pool's text encode since the last run comes first
        report.record(settings.text_stage)
    settings.text_stage, settings.text_notes = None, []
    oom = _oom_types(mm)
    offload, budget = settings.offload, settings.budget_bytes
    try:
        try:
            return _attempt(settings, patcher, run, mm, total_bytes, device, offload, budget, report, "sampling",
                            notes)
        except oom as e:
            first = e
        retry_offload, retry_budget = _more_offload(settings, mm, patcher, device, total_bytes)
        mm.free_memory(1e30, device)
        mm.soft_empty_cache()
        what = "out of memory at budget %s, offload %s (%s): memory freed, retried once with offload %s, budget %s" % (
            _gib(budget), offload, first_line(first, 120),
            retry_offload, _gib(retry_budget))
        notes.append(what)
        log.warning("[SD Accel] VRAM Pool: %s", what)
        if before_retry is not None:
            before_retry()
        try:
            return _attempt(settings, patcher, run, mm, total_bytes, device, retry_offload, retry_budget, report,
                            "sampling (retry)", notes)
        except oom as e:
            raise RuntimeError(
                "VRAM Pool: out of memory twice: at budget %s with offload %s, then at %s with offload %s. "
                "Lower the resolution or batch size, set offload to lowvram with a smaller budget_gib (the "
                "minimum for this model is %s), or close other programs using the GPU." % (
                    _gib(budget), offload, _gib(retry_budget), retry_offload,
                    _gib(settings.plan.min_budget_bytes) if settings.plan is not None else "in the node's plan")
            ) from e
    finally:
        if settings.release_cache == "after_run":
            mm.soft_empty_cache()
            notes.append("cache released")
        settings.last_report, settings.last_notes = report.to_dict(), notes
        log.info("[SD Accel] VRAM Pool: %s | %s", report.summary(), "; ".join(notes) or "defaults")


def pool_settings(model):
    """The PoolSettings a VRAM Pool put on `model` (a ModelPatcher), or None."""
    get = getattr(model, "get_wrappers", None)
    if get is None:
        return None
    try:
        import comfy.patcher_extension as pe
        wrappers = get(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)
    except Exception:  # noqa: BLE001 - a host without keyed wrappers carries no pool
        return None
    return getattr(wrappers[0], "sd_accel_pool", None) if wrappers else None


class NoClipConnected(AttributeError):
    """An AttributeError, so that probes (hasattr, copy's __deepcopy__ lookup) see a plain missing attribute."""


class NoClip:
    """The VRAM Pool's clip output when nothing is connected to its clip input: any use says so."""

    def __getattr__(self, name):
        raise NoClipConnected("VRAM Pool: its clip output is used (%s), but nothing is connected to its clip "
                              "input. Connect the checkpoint's CLIP to the VRAM Pool's clip input, or take the "
                              "CLIP from the loader directly." % name)


def pool_clip(clip, settings, mm=None):
    """A clone of `clip` whose encodes run as the pool's "text encode" stage: ComfyUI's loader sees the budget
    while it loads the text encoder (as it does for sampling: a text encoder larger than the budget is
    partially loaded, as --lowvram does), and the stage's peak allocated and reserved memory joins the report
    of the pool's next sampling run. The wrapper is an attribute of this clone: a CLIP cloned from it later
    (a LoRA loader after the pool) encodes the stock way, so connect this output to the text encoders."""
    out = clip.clone()
    encode = out.encode_from_tokens        # bound to the clone; ComfyUI's scheduled encode calls it too

    def encode_from_tokens(*args, **kwargs):
        return text_stage(settings, out, lambda: encode(*args, **kwargs), mm)
    out.encode_from_tokens = encode_from_tokens
    out.sd_accel_pool = settings
    return out


def text_stage(settings, clip, run, mm=None):
    """Runs `run()` (one encode of the pool's CLIP) under the pool's budget, measured as "text encode"."""
    mm = mm or _mm()
    patcher = getattr(clip, "patcher", None)
    device = torch.device(getattr(patcher, "load_device", "cpu"))
    report, notes = vram_report.MemoryReport(), []
    with contextlib.ExitStack() as stack:
        budget = settings.budget_bytes
        if budget and device.type == "cuda":
            why = budget_supported(mm)
            total = mm.get_total_memory(device) if why is None else 0
            if why:
                notes.append("text encode: budget not enforced (%s)" % why)
            elif budget < total:
                stack.enter_context(budget_scope(mm, budget, total))
                notes.append("text encode under the budget (%.2f GiB)" % (budget / GIB))
        with report.stage("text encode", device):
            out = run()
    entry = report.stages[-1]
    old = settings.text_stage
    if old is None or (entry["peak_allocated"] or 0) >= (old["peak_allocated"] or 0):
        settings.text_stage = entry           # two encodes per prompt (positive, negative): the larger peak
    for n in notes:
        if n not in settings.text_notes:
            settings.text_notes.append(n)
    return out


def _gib(n):
    return "%.2f GiB" % (n / GIB) if n else "none (no cap)"


def promote_blocks(sizes, room, depth):
    """Of the streamed blocks [(name, bytes)] (execution order), those moved to the GPU for the run: ComfyUI's
    loader keeps its own reserve free of weights, sized for any model, so the budget often has room left.
    The planner's rule on what is left: largest first, while they plus the ring of the rest fit `room`."""
    if not sizes or room <= 0:
        return []
    try:
        return vram_plan.plan_residency(sizes, room, 0, depth).resident
    except vram_plan.BudgetTooSmall:     # not even the ring of all of them fits: nothing to promote
        return []


def _fit_and_streamed(settings, patcher, unet, device, budget, notes, noise_shape=None):
    """(blocks to stream, prefetch depth, blocks to move to the GPU for the run). Under a budget, ComfyUI's
    placement is first made to fit: activations (ComfyUI's estimate for this run's shape, CFG batch) +
    everything allocated now + the ring of the streamed blocks <= budget, by letting ComfyUI unload more (its
    own partially_unload, smallest modules first); then what room is left (less PROMOTE_MARGIN) takes the
    largest streamed blocks (promote_blocks)."""
    depth = settings.plan.prefetch_depth if settings.plan is not None else PREFETCH_DEPTH
    if device.type != "cuda" or settings.stream_every_block:     # tests: every block, copied
        return [n for n, _ in vram_plan.stream_units(unet)], depth, []
    act = settings.plan.activation_bytes if settings.plan is not None else 0
    if noise_shape is not None:
        try:
            act = int(patcher.model.memory_required([noise_shape[0] * 2] + list(noise_shape[1:])))
        except Exception:  # noqa: BLE001 - keep the planner's estimate
            pass
    act = int(act * ACTIVATION_SAFETY)
    for _ in range(4):
        off = block_offload.off_device_bytes(unet, device)
        on = block_offload.on_device_bytes(unet, device)
        est = act + torch.cuda.memory_allocated(device) + vram_plan.ring_bytes([b for b in off.values() if b], depth)
        if not budget or est <= budget or not hasattr(patcher, "partially_unload"):
            break
        if not patcher.partially_unload(patcher.offload_device, est - budget):
            break
    streamed = [n for n, b in off.items() if b]
    room = int(budget * (1 - PROMOTE_MARGIN)) - act - torch.cuda.memory_allocated(device) if budget else 0
    promoted = promote_blocks([(n, off[n]) for n in streamed], room, depth)
    streamed = [n for n in streamed if n not in promoted]
    est = act + torch.cuda.memory_allocated(device) + sum(off[n] for n in promoted) + vram_plan.ring_bytes(
        [off[n] for n in streamed], depth)
    notes.append("lowvram: estimated peak %.2f GiB (%.2f GiB weights resident%s)" % (
        est / GIB, on / GIB, ", %d more blocks (%.2f GiB) moved to the GPU for the run" % (
            len(promoted), sum(off[n] for n in promoted) / GIB) if promoted else ""))
    return streamed, depth, promoted


@contextlib.contextmanager
def _sampling_tables_on(device, base_model):
    """ComfyUI's partial loading leaves the model's `model_sampling` (sigma tables, a few KiB) on the CPU, so
    every step copies its timestep there and back, which a CUDA graph cannot capture (device run 19). For
    the streamed run they live on the GPU; put back after."""
    moved = []
    ms = getattr(base_model, "model_sampling", None)
    if ms is not None:
        for m in ms.modules():
            for name, b in m._buffers.items():
                if b is not None and b.device != device:
                    moved.append((m, name, b))
                    m._buffers[name] = b.to(device)
    try:
        yield len(moved)
    finally:
        for m, name, b in moved:
            m._buffers[name] = b


@contextlib.contextmanager
def stream_scope(settings, patcher, budget, notes, noise_shape=None):
    """Inside one sampling run, after ComfyUI loaded the model: stream what it left off the GPU."""
    device = torch.device(patcher.load_device)
    unet = patcher.model.diffusion_model
    streamed, depth, promoted = _fit_and_streamed(settings, patcher, unet, device, budget, notes, noise_shape)
    if not streamed:
        with block_offload.resident_blocks(device, unet, promoted, settings.promoted_cache):
            notes.append("lowvram: the whole UNet fit in the budget, nothing streamed")
            yield None
        return
    streamer = block_offload.BlockStreamer(unet, streamed, prefetch_depth=depth, device=device,
                                           pinned_cache=settings.pinned_cache,
                                           every_tensor=settings.stream_every_block)
    streamer.install()
    settings.last_streamer, per_step, ring = streamer, streamer.streamed_bytes, streamer.ring_bytes
    try:
        with _sampling_tables_on(device, patcher.model), \
                block_offload.resident_blocks(device, unet, promoted, settings.promoted_cache):
            yield streamer
    finally:
        streamer.remove()
        notes.append("lowvram: %d of %d blocks streamed (%.2f GiB per step through a %.2f GiB ring, prefetch depth "
                     "%d; outside graph replays: %d block copies, %d loaded on demand)"
                     % (len(streamed), len(streamer.blocks), per_step / GIB, ring / GIB, depth,
                        streamer.stats["copies"], streamer.stats["demand_loads"]))


def _outer_sample_wrapper(settings):
    def wrapper(executor, *args, **kwargs):
        guider = executor.class_obj
        patcher = guider.model_patcher
        saved = {k: [c.copy() for c in v] for k, v in guider.conds.items()} if isinstance(
            getattr(guider, "conds", None), dict) else None

        def before_retry():     # the run processed the conds in place of the guider's copies: start afresh
            if saved is not None:
                guider.conds = {k: [c.copy() for c in v] for k, v in saved.items()}
        return run_in_pool(settings, patcher, lambda: executor(*args, **kwargs), before_retry=before_retry)
    wrapper.sd_accel_pool = settings
    wrapper.sd_accel_inert = ("vram pool", "outer sample")   # around sampling: no part of a step's graph
    return wrapper


def _sampler_sample_wrapper(settings):
    """Runs after ComfyUI loaded the models (inside outer_sample): where lowvram streaming starts and ends."""
    def wrapper(executor, *args, **kwargs):
        active = settings.active
        if not active or active["offload"] != "lowvram":
            return executor(*args, **kwargs)
        noise = args[4] if len(args) > 4 else kwargs.get("noise")
        with stream_scope(settings, args[0].model_patcher, active["budget"], active["notes"],
                          getattr(noise, "shape", None)):
            return executor(*args, **kwargs)
    wrapper.sd_accel_pool = settings
    wrapper.sd_accel_inert = ("vram pool", "sampler sample")
    return wrapper


def plan_for_budget(sizes, budget, activation_bytes):
    """(plan, notes). Prefetching the next block needs room for two streamed blocks at once; a budget that
    fits only one (SDXL at 2 GiB: its largest block is 0.77 GiB) runs without prefetch, slower, rather than
    being refused. Below even that: ValueError naming the minimum."""
    try:
        return vram_plan.plan_residency(sizes, budget, activation_bytes, PREFETCH_DEPTH), []
    except vram_plan.BudgetTooSmall as with_prefetch:
        try:
            plan = vram_plan.plan_residency(sizes, budget, activation_bytes, 0)
        except vram_plan.BudgetTooSmall as e:
            raise ValueError("VRAM Pool: %s. Raise budget_gib to at least %.2f, or set it to 0 (no cap)."
                             % (e, e.needed / GIB)) from e
        note = ("prefetch off: the budget holds one streamed block at a time (%.2f GiB needed to prefetch); "
                "each block's copy waits for the one before it, slower" % (with_prefetch.needed / GIB))
        log.info("[SD Accel] VRAM Pool: %s", note)
        return plan, [note]




def make_pool(model, budget_gib, offload, release_cache, expandable_segments):
    """(clone of `model` carrying the pool's wrappers, report line, UI dict): the VRAM Pool node's work."""
    mm = _mm()
    budget = int(round(float(budget_gib) * GIB))
    sizes = vram_plan.unet_block_sizes(diffusion_model(model))
    plan, notes = plan_for_budget(sizes, budget, activation_estimate(mm, model))
    settings = PoolSettings(budget, offload, release_cache, bool(expandable_segments), plan)
    clone = model.clone()
    unsupported = budget_supported(mm, clone)
    if unsupported is None:
        import comfy.patcher_extension as pe
        clone.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, _outer_sample_wrapper(settings))
        clone.add_wrapper_with_key(pe.WrappersMP.SAMPLER_SAMPLE, WRAPPER_KEY, _sampler_sample_wrapper(settings))
    else:
        notes.append("NOT enforced: %s; the plan below is advisory" % unsupported)
        log.warning("[SD Accel] VRAM Pool settings not enforced: %s", unsupported)
    streaming = None
    if offload == "lowvram":
        why = streaming_unavailable(mm, clone, torch.device(clone.load_device))
        streaming = why is None
        if why:
            notes.append("lowvram: block streaming off (%s); runs as offload=none" % why)
            log.warning("[SD Accel] VRAM Pool: lowvram block streaming off (%s); runs as offload=none", why)
    ui = plan.to_dict()
    ui.update(resident_count=len(plan.resident), streamed_count=len(plan.streamed), offload=offload,
              release_cache=release_cache, expandable_segments=bool(expandable_segments),
              enforced=unsupported is None, streaming=streaming, notes=notes)
    placement = ("ComfyUI's partial loading, the rest streamed" if streaming else "ComfyUI's partial loading")
    line = ("VRAM Pool: plan for block streaming: %s (placement: %s); offload %s, "
            "release cache %s, expandable segments %s%s") % (
        plan.summary(), placement, offload, release_cache, "on" if expandable_segments else "off",
        " | " + "; ".join(notes) if notes else "")
    log.info("[SD Accel] %s", line)
    return clone, line, ui
