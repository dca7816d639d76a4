"""Promoted blocks: stream units whose weights ComfyUI left off the GPU, given GPU copies for one run where the
budget has room for them (the VRAM Pool's choice: engine/memory/vram_plan.py, RunPlacement.after_load), and
their host data put back after. Host-agnostic.
"""
import contextlib

import torch

from .block_buffers import adopt, block_layout, host_flats
from .stream_units import is_on, owned_tensors, stream_units


@contextlib.contextmanager
def resident_blocks(device, unet, names, pinned_cache=None):
    """The off-device tensors of UNet blocks `names` given GPU copies for the scope (the VRAM Pool's promoted
    blocks), their host data put back after. With `pinned_cache` (a dict kept across runs, as the streamer's)
    each block's copy comes from one pinned host buffer built on its first run: ~50 GB/s instead of the
    ~9 GB/s of a copy from pageable memory (SDXL at a 4 GiB budget promotes ~0.9 GiB per run). A tensor the run
    converted to channels_last leaves its host data converted too (put_back), so later runs, which do not
    convert again, keep the layout."""
    moved = []
    blocks = dict(stream_units(unet))
    per_block = [[t for _, t in owned_tensors(blocks[name]) if not is_on(t, device)] for name in names]
    per_block = [ts for ts in per_block if ts]
    try:
        if pinned_cache is not None and torch.device(device).type == "cuda":
            new_cache = {}
            items = [([t.data for t in tensors], *block_layout(tensors)) for tensors in per_block]
            # the pinned views are the host data from now on (the model's own copies freed, not duplicated)
            hosts = [views for _, views in host_flats(items, True, pinned_cache, new_cache)]
            for tensors, (old, _, _), views in zip(per_block, items, hosts):
                adopt(tensors, old, views)
            pinned_cache.clear()
            pinned_cache.update(new_cache)
        else:
            hosts = [[t.data for t in tensors] for tensors in per_block]
        for tensors, views in zip(per_block, hosts):
            for t, host in zip(tensors, views):
                moved.append((t, host))       # first: an out-of-memory below still puts it back
                t.data = host.to(device, non_blocking=host.is_pinned())    # keeps a dense host's strides
        yield len(moved)
    finally:
        for t, host in moved:
            put_back(t, host)


def put_back(t, host):
    """t.data = host, converting host to channels_last first when the run converted t's copy."""
    if (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
            and not host.is_contiguous(memory_format=torch.channels_last)):
        host = host.contiguous(memory_format=torch.channels_last)
    t.data = host
