"""ComfyUI host, offload=lowvram: inside one sampling run, once ComfyUI's loader has partially loaded the UNet,
what it left on the CPU is streamed unit by unit into a GPU ring (engine/memory/offload.py), and the largest
units move to the GPU for the run where the budget has room (engine/memory/promoted_blocks.py). The planner
decides (engine/memory/vram_plan.py: RunPlacement); this file measures what ComfyUI placed and applies it."""
import contextlib

import torch

from ...engine.memory import offload as block_offload, promoted_blocks, stream_units
from ...engine.memory.vram_plan import GIB
from . import families
from .memory_scopes import budget_supported


def streaming_unavailable(mm, patcher, device, settings=None):
    """None when lowvram block streaming can run for this model here, else why not."""
    why = budget_supported(mm, patcher) or families.unsupported_reason(patcher)
    if why:
        return why
    if device.type != "cuda" and not (settings is not None and settings.stream_every_block):
        return "the model runs on %s, streaming needs a CUDA device" % device.type
    return None


def _run_estimate(patcher, noise_shape):
    """ComfyUI's activation estimate for this run's shape (CFG batch: twice the noise's), or None."""
    if noise_shape is None:
        return None
    try:
        return int(patcher.model.memory_required([noise_shape[0] * 2] + list(noise_shape[1:])))
    except Exception:  # noqa: BLE001 - keep the planner's estimate
        return None


def _fit_and_streamed(settings, patcher, unet, device, placement, notes, noise_shape=None):
    """(blocks to stream, blocks to move to the GPU for the run). Under a budget, ComfyUI's placement is first
    made to fit (placement.overflow) by letting ComfyUI unload more (its own partially_unload, smallest modules
    first); then what room is left takes the largest streamed blocks (placement.after_load)."""
    if device.type != "cuda" or settings.stream_every_block:     # tests: every block, copied
        return [n for n, _ in stream_units.stream_units(unet)], []
    act = placement.run_activation_bytes(_run_estimate(patcher, noise_shape))
    for _ in range(4):
        off = stream_units.off_device_bytes(unet, device)
        on = stream_units.on_device_bytes(unet, device)
        excess = placement.overflow(act, torch.cuda.memory_allocated(device), off)
        if excess <= 0 or not hasattr(patcher, "partially_unload"):
            break
        if not patcher.partially_unload(patcher.offload_device, excess):
            break
    streamed, promoted, peak = placement.after_load(act, torch.cuda.memory_allocated(device), off)
    notes.append("lowvram: estimated peak %.2f GiB (%.2f GiB weights resident%s)" % (
        peak / GIB, on / GIB, ", %d more blocks (%.2f GiB) moved to the GPU for the run" % (
            len(promoted), sum(off[n] for n in promoted) / GIB) if promoted else ""))
    return streamed, promoted


@contextlib.contextmanager
def _sampling_tables_on(device, base_model):
    """ComfyUI's partial loading leaves the model's `model_sampling` (sigma tables, a few KiB) on the CPU, so
    every step copies its timestep there and back, which a CUDA graph cannot capture. For the streamed run
    they live on the GPU; put back after."""
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
def stream_scope(settings, patcher, placement, notes, noise_shape=None):
    """Inside one sampling run, after ComfyUI loaded the model: stream what it left off the GPU, as the run's
    `placement` (vram_plan.RunPlacement) says."""
    device = torch.device(patcher.load_device)
    unet = patcher.model.diffusion_model
    streamed, promoted = _fit_and_streamed(settings, patcher, unet, device, placement, notes, noise_shape)
    if not streamed:
        with promoted_blocks.resident_blocks(device, unet, promoted, settings.promoted_cache):
            notes.append("lowvram: the whole UNet fit in the budget, nothing streamed")
            yield None
        return
    depth = placement.prefetch_depth
    streamer = block_offload.BlockStreamer(unet, streamed, prefetch_depth=depth, device=device,
                                           pinned_cache=settings.pinned_cache,
                                           every_tensor=settings.stream_every_block)
    streamer.install()
    settings.last_streamer, per_step, ring = streamer, streamer.streamed_bytes, streamer.ring_bytes
    try:
        with _sampling_tables_on(device, patcher.model), \
                promoted_blocks.resident_blocks(device, unet, promoted, settings.promoted_cache):
            yield streamer
    finally:
        streamer.remove()
        notes.append("lowvram: %d of %d blocks streamed (%.2f GiB per step through a %.2f GiB ring, prefetch depth "
                     "%d; outside graph replays: %d block copies, %d loaded on demand)"
                     % (len(streamed), len(streamer.blocks), per_step / GIB, ring / GIB, depth,
                        streamer.stats["copies"], streamer.stats["demand_loads"]))
