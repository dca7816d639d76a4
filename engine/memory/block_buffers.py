"""A block's tensors in one host buffer with the block's layout (pinned when it streams to a GPU): one
host-to-device copy per block, for the streamer's ring (engine/memory/offload.py) and the promoted blocks
(engine/memory/promoted_blocks.py) alike. The buffers become the tensors' host data for good, so the model's
own host copies are freed rather than kept beside them, and are reused across runs (a cache keyed by the
tensors' pointers). Host-agnostic.
"""
from . import host_mirror
from .pinned_memory import aligned, host_buffers, nbytes, view_as


def host_flats(blocks, pin, cache, new_cache):
    """Each block's host tensors in one uint8 host buffer. `blocks`: [(hosts, offsets, nbytes)] with `hosts[i]`
    the current host data of one of the block's tensors, placed at byte `offsets[i]` of a buffer of `nbytes`.
    Returns [(buffer, views)] per block: `views[i]` holds hosts[i]'s values in the buffer, for the caller to use
    as the tensor's host data from now on, so the model's own copies are freed rather than kept beside the
    pinned ones (a block with device tensors, the tests' stream-every-block switch, keeps its hosts). The
    buffers built here are allocated together (pinned and packed when `pin`: engine/memory/pinned_memory.py); a
    block whose hosts are already views of a buffer in `cache` (keyed by their pointers, valid while the cache
    or a view keeps the buffer alive) reuses it. Every buffer used is entered in `new_cache` (the caller swaps
    caches, so buffers no longer used are dropped)."""
    on_host = [all(h.device.type == "cpu" for h in hosts) for hosts, _, _ in blocks]
    out, build = [None] * len(blocks), []
    for k, (hosts, _, size) in enumerate(blocks):
        flat = cache.get(_key(hosts)) if on_host[k] else None
        if flat is not None and flat.numel() == size:
            out[k] = flat
        else:
            build.append(k)
    for k, flat in zip(build, host_buffers([blocks[k][2] for k in build], pin)):
        for host, off in zip(blocks[k][0], blocks[k][1]):
            view_as(flat, off, host).copy_(host)
        out[k] = flat
    result = []
    for (hosts, offsets, _), flat, host_only in zip(blocks, out, on_host):
        if not host_only:
            # a device tensor's pointer may be reused with other contents: such a block is built every time
            result.append((flat, list(hosts)))
            continue
        views = [view_as(flat, off, host) for host, off in zip(hosts, offsets)]
        new_cache[_key(views)] = flat
        result.append((flat, views))
    return result


def adopt(tensors, hosts, views):
    """A host mirror's copy of a tensor the buffer now holds is dropped (engine/memory/host_mirror.adopt): after
    a full load the mirror copied every weight off the GPU, the streamed ones included."""
    for t, host, view in zip(tensors, hosts, views):
        if view.data_ptr() != host.data_ptr():
            host_mirror.adopt(t, host, view)


def block_layout(tensors):
    """(byte offset of each tensor, total bytes) of `tensors` laid out one after another, each place aligned:
    a block's layout in its host buffer and in its ring place alike."""
    offsets, n = [], 0
    for t in tensors:
        offsets.append(n)
        n += aligned(nbytes(t))
    return offsets, n


def _key(hosts):
    # no version counters: a cache hit means `hosts` are views of that very buffer, so a host's in-place
    # write (a weight patch) is already in it; a replaced tensor has another pointer and rebuilds the buffer
    return tuple((h.data_ptr(), tuple(h.shape), tuple(h.stride()), h.dtype) for h in hosts)
