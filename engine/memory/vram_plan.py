"""Which UNet blocks stay on the GPU under a VRAM budget, and in which order the others are prefetched.

Host-agnostic and pure: sizes in, a plan out. No ComfyUI import; `unet_block_sizes` only walks the
attributes an ldm `UNetModel` has (time_embed, label_emb, input_blocks, middle_block, output_blocks, out).

The unit of placement (a "block" below) is a stream unit (`stream_units`): each child of a top-level block of
ldm's UNetModel (a ResBlock, a Downsample or Upsample) and each transformer block of a SpatialTransformer, the
transformer's own layers joining the unit that runs next to them (norm and proj_in the ResBlock before its
blocks, proj_out its last block). Whole top-level blocks were the unit before device run 38: SDXL's largest
(ten transformer blocks) is 0.66 GiB, so a ring holding two of them took 1.32 GiB of a 4 GiB budget; its
largest unit is 0.095 GiB, and what the ring no longer takes stays resident instead of being copied every step.

The model of a denoising step: the units run one after another in execution order. A *resident*
block lives on the GPU for the whole run. A *streamed* block's weights are copied into a fixed place of one
GPU ring buffer before it runs (engine/memory/offload.py): with `prefetch_depth = d`, while streamed block s[i]
computes, the copies of s[i+1..i+d] are in flight, and s[0..d] are copied at the start of each step. Fixed
places (the same addresses at every step) are what lets a CUDA graph replay a step, copies included. Each
block's place follows the one before it, wrapping to the ring's start when it does not fit at the end,
and never overlaps the d blocks before it (one computing, the others in flight): `ring_layout`. So

    peak = activation_bytes + sum(resident) + ring(streamed)

where the ring is at least the largest sum of 1 + d consecutive streamed blocks (the "window").

Rule for choosing the resident set: start from everything streamed (the floor, see `min_budget`) and make
blocks resident largest first (the blocks whose streaming would move the most bytes per step), keeping a
block only when the peak still fits the budget; passes repeat until nothing more fits. Streaming moves
sum(streamed) bytes per step, so keeping the largest blocks resident is what saves the most transfer time
for a given budget.
"""
import dataclasses
import functools
from dataclasses import dataclass, field

GIB = 2 ** 30

# top-level children of ldm's UNetModel in the order its forward() runs them
_UNET_ORDER = ("time_embed", "label_emb", "input_blocks", "middle_block", "output_blocks", "out")


class BudgetTooSmall(ValueError):
    """Even with every block streamed the step cannot fit. `needed` and `given` are bytes."""

    def __init__(self, needed, given, detail=""):
        self.needed, self.given = int(needed), int(given)
        msg = ("VRAM budget %.2f GiB is too small for this model: it needs at least %.2f GiB (%s)"
               % (self.given / GIB, self.needed / GIB, detail or "activations plus the streamed blocks in flight"))
        super().__init__(msg)


@dataclass
class ResidencyPlan:
    """The result of `plan_residency`. Block lists are in execution order; bytes are ints."""
    resident: list
    streamed: list
    prefetch: list            # [(streamed block, block during whose compute its copy starts | None: step start)]
    peak_bytes: int
    min_budget_bytes: int
    budget_bytes: int         # 0: no cap
    activation_bytes: int
    prefetch_depth: int
    resident_bytes: int
    streamed_bytes: int       # bytes copied to the GPU per step
    sizes: dict = field(default_factory=dict, repr=False)

    def to_dict(self):
        d = {k: getattr(self, k) for k in ("resident", "streamed", "peak_bytes", "min_budget_bytes", "budget_bytes",
                                           "activation_bytes", "prefetch_depth", "resident_bytes", "streamed_bytes")}
        d["prefetch"] = [list(p) for p in self.prefetch]
        d["peak_gib"] = round(self.peak_bytes / GIB, 3)
        return d

    def summary(self):
        cap = "%.2f GiB" % (self.budget_bytes / GIB) if self.budget_bytes else "no cap"
        return ("%d blocks resident (%.2f GiB), %d streamed (%.2f GiB/step), estimated peak %.2f GiB, budget %s"
                % (len(self.resident), self.resident_bytes / GIB, len(self.streamed), self.streamed_bytes / GIB,
                   self.peak_bytes / GIB, cap))


def _window(sizes, depth):
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
    `_ring_layout`. Memoized: the planner asks for the same layouts at every prompt (device run 43: planning
    95 SDXL units took ~100 ms of every prompt before the first step)."""
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
    window = _window(sizes, depth)
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


def _peak(order, resident, sizes, activation_bytes, depth):
    streamed = [sizes[b] for b in order if b not in resident]
    return activation_bytes + sum(sizes[b] for b in resident) + ring_bytes(streamed, depth)


def _fits(order, resident, sizes, activation_bytes, depth, budget):
    """_peak(...) <= budget, without laying out the ring when even its lower bound (the window) does not fit:
    most candidates the planner tries fail that way, and a layout is the expensive part."""
    streamed = [sizes[b] for b in order if b not in resident]
    base = activation_bytes + sum(sizes[b] for b in resident)
    if base + _window(streamed, depth) > budget:
        return False
    return base + ring_bytes(streamed, depth) <= budget


def min_budget(block_sizes, activation_bytes, prefetch_depth=1):
    """The planner's floor: everything streamed (activations plus the ring). Below it `plan_residency` raises
    BudgetTooSmall."""
    order = [n for n, _ in block_sizes]
    return _peak(order, set(), dict(block_sizes), int(activation_bytes), int(prefetch_depth))


def plan_residency(block_sizes, budget_bytes, activation_bytes, prefetch_depth=1):
    """Plan which blocks stay resident within `budget_bytes` (0 or None: no cap, everything resident).

    block_sizes: [(name, bytes)] in execution order (see `unet_block_sizes`). activation_bytes: what the step
    needs besides weights. prefetch_depth: streamed blocks copied ahead of the one computing (>= 0).
    Raises BudgetTooSmall (with the minimum and the given budget) when even full streaming does not fit.
    Memoized on its arguments (a pure function; the VRAM Pool plans the same placement at every prompt):
    each call returns its own copy.
    """
    plan = _plan_cached(tuple((n, int(s)) for n, s in block_sizes), int(budget_bytes or 0), int(activation_bytes),
                        prefetch_depth)
    return dataclasses.replace(plan, resident=list(plan.resident), streamed=list(plan.streamed),
                               prefetch=list(plan.prefetch), sizes=dict(plan.sizes))


@functools.lru_cache(maxsize=256)
def _plan_cached(block_sizes, budget_bytes, activation_bytes, prefetch_depth):
    return _plan_residency(list(block_sizes), budget_bytes, activation_bytes, prefetch_depth)


def _plan_residency(block_sizes, budget_bytes, activation_bytes, prefetch_depth):
    if prefetch_depth < 0:
        raise ValueError("prefetch_depth must be >= 0, got %r" % (prefetch_depth,))
    names = [n for n, _ in block_sizes]
    if len(set(names)) != len(names):
        raise ValueError("block names must be unique")
    sizes = {n: int(s) for n, s in block_sizes}
    if any(s < 0 for s in sizes.values()):
        raise ValueError("block sizes must be >= 0")
    act, depth, budget = int(activation_bytes), int(prefetch_depth), int(budget_bytes or 0)
    floor = _peak(names, set(), sizes, act, depth)
    if not budget:
        resident = set(names)
    else:
        if budget < floor:
            largest = max(sizes.values()) if sizes else 0
            raise BudgetTooSmall(floor, budget, "%.2f GiB activations + %.2f GiB of streamed blocks in flight: "
                                 "the largest block is %.2f GiB, prefetch depth %d"
                                 % (act / GIB, (floor - act) / GIB, largest / GIB, depth))
        resident = set()
        by_size = sorted(names, key=lambda b: (-sizes[b], names.index(b)))
        changed = True
        while changed:
            changed = False
            for b in by_size:
                if b not in resident and _fits(names, resident | {b}, sizes, act, depth, budget):
                    resident.add(b)
                    changed = True
    streamed = [b for b in names if b not in resident]
    # streamed[0..depth] are copied when the step starts (None); streamed[j], j > depth, while streamed[j-depth]
    # computes (the copy that follows the block before it, into the place the block before that freed)
    prefetch = [(b, streamed[j - depth] if j > depth else None) for j, b in enumerate(streamed)]
    return ResidencyPlan(
        resident=[b for b in names if b in resident], streamed=streamed, prefetch=prefetch,
        peak_bytes=_peak(names, resident, sizes, act, depth), min_budget_bytes=floor, budget_bytes=budget,
        activation_bytes=act, prefetch_depth=depth, resident_bytes=sum(sizes[b] for b in resident),
        streamed_bytes=sum(sizes[b] for b in streamed), sizes=sizes)


def _param_bytes(modules):
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


# a SpatialTransformer is split only when these are all its children, registered in the order its forward
# runs them (ComfyUI's and ldm's): norm, proj_in, the transformer blocks, proj_out
_TRANSFORMER_CHILDREN = {"norm", "proj_in", "transformer_blocks", "proj_out"}


def _split_transformer(child):
    names = [n for n, _ in child.named_children()]
    tb = getattr(child, "transformer_blocks", None)
    return (tb is not None and len(tb) > 0 and set(names) <= _TRANSFORMER_CHILDREN
            and names.index("transformer_blocks") == len([n for n in names if n in ("norm", "proj_in")]))


def stream_units(unet):
    """[(name, [modules])] of an ldm UNetModel in execution order, each unit's modules running one after
    another in a step (a unit is entered once per step), together holding every parameter under the top-level
    blocks: time_embed, label_emb, out whole; each child of input_blocks.i, middle_block, output_blocks.i
    ("input_blocks.4.0" a ResBlock, "output_blocks.2.2" an Upsample), a SpatialTransformer cut into its
    transformer blocks ("input_blocks.4.1.transformer_blocks.0"), its norm and proj_in joining the unit before
    it (they run right after it), its proj_out its last block's. A top-level block that is not a sequence of
    children (extensions) is one unit under its own name."""
    units = []
    for attr in _UNET_ORDER:
        mod = getattr(unet, attr, None)
        if mod is None:
            continue
        if attr in ("input_blocks", "output_blocks"):
            blocks = [("%s.%d" % (attr, i), b) for i, b in enumerate(mod)]
        elif attr == "middle_block":
            blocks = [(attr, mod)]
        else:
            units.append((attr, [mod]))
            continue
        for bname, block in blocks:
            children = list(block.named_children())
            if not children or any(p is not None for p in block._parameters.values()):
                units.append((bname, [block]))
                continue
            first = len(units)
            for cname, child in children:
                cpath = "%s.%s" % (bname, cname)
                if not _split_transformer(child):
                    units.append((cpath, [child]))
                    continue
                for gname, g in child.named_children():
                    if gname == "transformer_blocks":
                        units.extend(("%s.transformer_blocks.%d" % (cpath, k), [t]) for k, t in enumerate(g))
                    elif len(units) > first:
                        units[-1][1].append(g)      # norm, proj_in: the unit before; proj_out: the last block
                    else:
                        units.append((cpath, [g]))  # a block that starts with its transformer
    return units


def unet_block_sizes(unet):
    """[(name, parameter bytes)] of an ldm UNetModel's stream units (`stream_units`), in execution order. Any
    other top-level child holding parameters (extensions of the class) follows, under its attribute name, so
    the sizes add up to the model's parameter bytes."""
    out, seen = [], set(a for a in _UNET_ORDER if getattr(unet, a, None) is not None)
    for name, mods in stream_units(unet):
        out.append((name, _param_bytes(mods)))
    for name, mod in unet.named_children():
        if name not in seen:
            n = _param_bytes([mod])
            if n:
                out.append((name, n))
    direct = sum(p.numel() * p.element_size() for p in unet.parameters(recurse=False))
    if direct:
        out.append(("(own parameters)", direct))
    return out
