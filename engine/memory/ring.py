"""Fixed places of the streamed blocks in one GPU ring buffer, for a prefetch depth. Pure arithmetic on sizes.

With `prefetch_depth = d`, while streamed block s[i] computes, the copies of s[i+1..i+d] are in flight
(engine/memory/offload.py). Each block's place follows the one before it, wrapping to the ring's start when it
does not fit at the end, and never overlaps the d blocks before it (one computing, the others in flight). The
places are the same at every step, which is what lets a CUDA graph replay a step, copies included. The ring
is at least the largest sum of 1 + d consecutive streamed blocks (the "window").
"""
import functools


def window_bytes(sizes, depth):
    """Largest sum of 1 + depth consecutive entries (all of them when there are fewer); not cyclic: each step
    starts its copies afresh."""
    k = 1 + depth
    if len(sizes) <= k:
        return sum(sizes)
    return max(sum(sizes[i:i + k]) for i in range(len(sizes) - k + 1))


def _clear(start, size, sizes, offsets, live):
    return all(not (size and sizes[j] and start < offsets[j] + sizes[j] and offsets[j] < start + size) for j in live)


def _place_after(sizes, depth, ring):
    """Offsets of `sizes` placed one after another in a ring of `ring` bytes (a block that does not fit at the
    end starts at 0), or None when a block would overlap one of the `depth` blocks before it."""
    offsets = []
    for i, size in enumerate(sizes):
        start = offsets[-1] + sizes[i - 1] if i else 0
        if start + size > ring:
            start = 0
        if size > ring or not _clear(start, size, sizes, offsets, range(max(0, i - depth), i)):
            return None
        offsets.append(start)
    return offsets


def _place_search(sizes, depth, ring, budget=20000):
    """Offsets of `sizes` in `ring` bytes, each clear of the `depth` blocks before it, found by a depth-first
    search over the addresses that can matter (0, the ring's end, and either side of each live block), or
    None (none found within `budget` search nodes)."""
    failed, offsets, left = set(), [], [budget]

    def go(i):
        if i == len(sizes):
            return True
        live = range(max(0, i - depth), i)
        state = (i, tuple(offsets[j] for j in live))
        if state in failed or left[0] <= 0:
            return False
        left[0] -= 1
        size = sizes[i]
        starts = {0, ring - size} | {offsets[j] + sizes[j] for j in live} | {offsets[j] - size for j in live}
        for st in sorted(x for x in starts if 0 <= x <= ring - size):
            if _clear(st, size, sizes, offsets, live):
                offsets.append(st)
                if go(i + 1):
                    return True
                offsets.pop()
        failed.add(state)
        return False
    return list(offsets) if go(0) else None


def ring_layout(sizes, depth):
    """(offsets, ring bytes) for streamed blocks of `sizes` (execution order) with prefetch `depth`; see
    `_ring_layout`. Memoized: the planner asks for the same layouts at every prompt, and laying out SDXL's 95
    units takes ~65-250 ms of CPU (bench/RESULTS.md, "Device runs 36-43")."""
    offsets, ring = _ring_layout_cached(tuple(int(s) for s in sizes), int(depth))
    return list(offsets), ring


@functools.lru_cache(maxsize=4096)
def _ring_layout_cached(sizes, depth):
    offsets, ring = _ring_layout(list(sizes), depth)
    return tuple(offsets), ring


def _ring_layout(sizes, depth):
    """(offsets, ring bytes) for streamed blocks of `sizes` (execution order) with prefetch `depth`: every
    block clear of the `depth` blocks before it (one computing, the others in flight when its copy starts).
    Starts from blocks placed one after another in a ring that wraps (the smallest of the window plus each
    block size that works, else the sum of all sizes, which always does: nothing wraps), then searches for
    the smallest ring down to the window (the largest sum of 1 + depth consecutive sizes, below which
    nothing fits)."""
    sizes = [int(s) for s in sizes]
    if not sizes:
        return [], 0
    window = window_bytes(sizes, depth)
    for ring in [window + s for s in sorted(set(sizes))] + [sum(sizes)]:
        offsets = _place_after(sizes, depth, ring)
        if offsets is not None:
            best = (offsets, ring)
            break
    if best[1] > window:
        offsets = _place_search(sizes, depth, window)
        if offsets is not None:
            return offsets, window
    lo, hi = window, best[1]                 # lo does not fit: the smallest ring found, to 1/64 of the window
    while hi - lo > max(1, window // 64):
        mid = (lo + hi) // 2
        offsets = _place_search(sizes, depth, mid)
        if offsets is None:
            lo = mid
        else:
            best, hi = (offsets, mid), mid
    return best


def ring_bytes(sizes, depth):
    """Bytes of the GPU ring that streams `sizes` (see `ring_layout`)."""
    return ring_layout(sizes, depth)[1]
