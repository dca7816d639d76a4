"""Which UNet blocks stay on the GPU under a VRAM budget, and in which order the others are prefetched.

Host-agnostic and pure: sizes in, a plan out. No ComfyUI import; `unet_block_sizes` only walks the
attributes an ldm `UNetModel` has (time_embed, label_emb, input_blocks, middle_block, output_blocks, out).

The model of a denoising step: the top-level blocks run one after another in execution order, and a step
is followed by the next step (the order is cyclic). A *resident* block lives on the GPU for the whole run.
A *streamed* block is copied to the GPU before it runs and freed after; with `prefetch_depth = d`, while
streamed block s[i] computes, the copies of the next d streamed blocks s[i+1..i+d] are in flight. So the
streamed blocks occupy at most the largest sum of 1 + d cyclically consecutive streamed blocks (the
"window"), and

    peak = activation_bytes + sum(resident) + window(streamed)

Rule for choosing the resident set: start from everything streamed (the smallest possible peak, see
`min_budget`) and make blocks resident largest first (the blocks whose streaming would move the most bytes
per step), keeping a block only when the peak still fits the budget; passes repeat until nothing more fits.
Streaming moves sum(streamed) bytes per step, so keeping the largest blocks resident is what saves the most
transfer time for a given budget.
"""
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
    prefetch: list            # [(streamed block, block during whose compute its copy starts)], execution order
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
    """Largest sum of 1 + depth cyclically consecutive entries (all of them when there are fewer)."""
    n = len(sizes)
    if n == 0:
        return 0
    k = 1 + depth
    if k >= n:
        return sum(sizes)
    return max(sum(sizes[(i + j) % n] for j in range(k)) for i in range(n))


def _peak(order, resident, sizes, activation_bytes, depth):
    streamed = [sizes[b] for b in order if b not in resident]
    return activation_bytes + sum(sizes[b] for b in resident) + _window(streamed, depth)


def min_budget(block_sizes, activation_bytes, prefetch_depth=1):
    """The smallest budget any plan fits in: everything streamed. Making a block resident never lowers the
    peak (it adds its bytes, and removes at most those bytes from any window), so this is the minimum. It is
    at most activation_bytes + largest block x (1 + prefetch_depth)."""
    order = [n for n, _ in block_sizes]
    return _peak(order, set(), dict(block_sizes), int(activation_bytes), int(prefetch_depth))


def plan_residency(block_sizes, budget_bytes, activation_bytes, prefetch_depth=1):
    """Plan which blocks stay resident within `budget_bytes` (0 or None: no cap, everything resident).

    block_sizes: [(name, bytes)] in execution order (see `unet_block_sizes`). activation_bytes: what the step
    needs besides weights. prefetch_depth: streamed blocks copied ahead of the one computing (>= 0).
    Raises BudgetTooSmall (with the minimum and the given budget) when even full streaming does not fit.
    """
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
                if b not in resident and _peak(names, resident | {b}, sizes, act, depth) <= budget:
                    resident.add(b)
                    changed = True
    streamed = [b for b in names if b not in resident]
    # while streamed[i] computes, streamed[i+1..i+depth] are in flight: streamed[j]'s copy starts with
    # streamed[j-depth]'s compute (cyclic: the first ones during the previous step's last streamed blocks;
    # on the very first step they are loaded before it starts)
    prefetch = []
    m = len(streamed)
    for j, b in enumerate(streamed):
        prefetch.append((b, streamed[(j - depth) % m] if depth else b))
    return ResidencyPlan(
        resident=[b for b in names if b in resident], streamed=streamed, prefetch=prefetch,
        peak_bytes=_peak(names, resident, sizes, act, depth), min_budget_bytes=floor, budget_bytes=budget,
        activation_bytes=act, prefetch_depth=depth, resident_bytes=sum(sizes[b] for b in resident),
        streamed_bytes=sum(sizes[b] for b in streamed), sizes=sizes)


def _param_bytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters())


def unet_block_sizes(unet):
    """[(name, parameter bytes)] for an ldm UNetModel's top-level blocks, in execution order: time_embed,
    label_emb (SDXL), input_blocks.i, middle_block, output_blocks.i, out. Any other top-level child holding
    parameters (extensions of the class) follows, under its attribute name, so the sizes add up to the
    model's parameter bytes."""
    out, seen = [], set()
    for attr in _UNET_ORDER:
        mod = getattr(unet, attr, None)
        if mod is None:
            continue
        seen.add(attr)
        if attr in ("input_blocks", "output_blocks"):
            out.extend(("%s.%d" % (attr, i), _param_bytes(b)) for i, b in enumerate(mod))
        else:
            out.append((attr, _param_bytes(mod)))
    for name, mod in unet.named_children():
        if name not in seen:
            n = _param_bytes(mod)
            if n:
                out.append((name, n))
    direct = sum(p.numel() * p.element_size() for p in unet.parameters(recurse=False))
    if direct:
        out.append(("(own parameters)", direct))
    return out
