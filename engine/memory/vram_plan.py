"""The VRAM planner: which UNet blocks stay on the GPU under a budget, in which order the others are prefetched,
and where one sampling run's weights go. Pure: block sizes, a budget and an activation estimate in, a plan
out; no ComfyUI import (the host measures and applies it: hosts/comfyui/memory.py and lowvram.py).

The unit of placement (a "block" below) is a stream unit (engine/memory/stream_units.py). The model of a
denoising step: the units run one after another in execution order. A *resident* block lives on the GPU for
the whole run. A *streamed* block's weights are copied into a fixed place of one GPU ring buffer before it runs
(engine/memory/offload.py; the places: engine/memory/ring.py): with `prefetch_depth = d`, while streamed block
s[i] computes, the copies of s[i+1..i+d] are in flight, and s[0..d] are copied at the start of each step. So

    peak = activation_bytes + sum(resident) + ring(streamed)

where the ring is at least the largest sum of 1 + d consecutive streamed blocks (the "window").

Rule for choosing the resident set: start from everything streamed (the floor, see `min_budget`) and make
blocks resident largest first (the blocks whose streaming would move the most bytes per step), keeping a
block only when the peak still fits the budget; passes repeat until nothing more fits. Streaming moves
sum(streamed) bytes per step, so keeping the largest blocks resident is what saves the most transfer time
for a given budget.

One sampling run (`place_run`, once per attempt): ComfyUI's loader is shown the budget less the ring and the
activations (`loader_budget`) and partially loads the model; once it has, the placement is made to fit
(`RunPlacement.overflow`: what ComfyUI must unload more) and the room left takes the largest streamed blocks
(`RunPlacement.after_load`, `promote_blocks`).
"""
import dataclasses
import functools
from dataclasses import dataclass, field

from .ring import ring_bytes, window_bytes

GIB = 2 ** 30
PREFETCH_DEPTH = 1       # streamed blocks copied ahead of the one computing
PROMOTE_MARGIN = 0.05    # of the budget, kept free of promoted blocks: ComfyUI's activation estimate is rough
# ComfyUI's activation estimate for the run's shape, times this, is what a run's placement keeps free: with
# the promoted blocks filling the room up to the margin, the estimate alone ran short (SDXL 1024² at 4 GiB
# peaked 0.29 GiB above ComfyUI's estimate of 0.64 GiB; bench/RESULTS.md, "Device runs 36-43", has the runs
# before and after the margin)
ACTIVATION_SAFETY = 1.5


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


def _peak(order, resident, sizes, activation_bytes, depth):
    streamed = [sizes[b] for b in order if b not in resident]
    return activation_bytes + sum(sizes[b] for b in resident) + ring_bytes(streamed, depth)


def _fits(order, resident, sizes, activation_bytes, depth, budget):
    """_peak(...) <= budget, without laying out the ring when even its lower bound (the window) does not fit:
    most candidates the planner tries fail that way, and a layout is the expensive part."""
    streamed = [sizes[b] for b in order if b not in resident]
    base = activation_bytes + sum(sizes[b] for b in resident)
    if base + window_bytes(streamed, depth) > budget:
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


# -- the node's plan and one run's placement ------------------------------------------------------------------

def plan_for_budget(block_sizes, budget_bytes, activation_bytes):
    """(plan, notes): the plan at prefetch depth PREFETCH_DEPTH, or at 0 with a note where the budget holds
    only one streamed block at a time (prefetching the next block needs room for two): slower, rather than
    refused. Below even that: BudgetTooSmall (its minimum is the floor without prefetch)."""
    try:
        return plan_residency(block_sizes, budget_bytes, activation_bytes, PREFETCH_DEPTH), []
    except BudgetTooSmall as with_prefetch:
        plan = plan_residency(block_sizes, budget_bytes, activation_bytes, 0)
        return plan, ["prefetch off: the budget holds one streamed block at a time (%.2f GiB needed to prefetch); "
                      "each block's copy waits for the one before it, slower" % (with_prefetch.needed / GIB)]


def _plan_at(plan, budget):
    """`plan` at another budget (a retry's); `plan` itself at its own, so a run does not plan again."""
    if int(budget) == plan.budget_bytes:
        return plan
    return plan_residency(list(plan.sizes.items()), budget, plan.activation_bytes, plan.prefetch_depth)


def loader_budget(plan, budget, comfy_reserve=None):
    """The budget ComfyUI's loader is shown with lowvram streaming: the budget less the planner's streaming
    ring at that budget (where the streamed blocks take turns) and its activation estimate, plus the inference
    reserve the loader subtracts itself (`comfy_reserve`), so it loads the planner's resident bytes."""
    if plan is None or not budget:
        return budget
    try:
        p = _plan_at(plan, budget)
        window = p.peak_bytes - p.activation_bytes - p.resident_bytes
    except BudgetTooSmall:
        window = plan.min_budget_bytes - plan.activation_bytes
    reserve = plan.activation_bytes if comfy_reserve is None else comfy_reserve
    # ComfyUI keeps its own reserve (0.8 GiB) free of weights, more than an SD1.5 step needs besides the ring,
    # so it is shown that much more; but never more than the budget: shown more, it loads the UNet's share
    # while the text encoders or the VAE are still there, and the run goes over the budget (SDXL at 4 GiB
    # peaked at 4.09 GiB: bench/RESULTS.md, "Device runs 36-43"). What room it leaves is filled after it
    # loaded, from pinned buffers (the promoted blocks, RunPlacement.after_load)
    return min(max(budget - window - plan.activation_bytes + reserve, 0), budget)


def promote_blocks(sizes, room, depth):
    """Of the streamed blocks [(name, bytes)] (execution order), those moved to the GPU for the run: ComfyUI's
    loader keeps its own reserve free of weights, sized for any model, so the budget often has room left.
    The planner's rule on what is left: largest first, while they plus the ring of the rest fit `room`."""
    if not sizes or room <= 0:
        return []
    try:
        return plan_residency(sizes, room, 0, depth).resident
    except BudgetTooSmall:     # not even the ring of all of them fits: nothing to promote
        return []


@dataclass(frozen=True)
class RunPlacement:
    """Where one sampling run's weights go under `budget_bytes` (0: no cap), decided before ComfyUI loads the
    model (`place_run`) and finished once it has, from what it left off the GPU (`overflow`, `after_load`)."""
    budget_bytes: int
    loader_bytes: int         # the budget ComfyUI's loader is shown
    prefetch_depth: int
    activation_bytes: int     # the node's estimate (the model's native size); 0 without a plan

    def run_activation_bytes(self, estimate=None):
        """What the placement keeps free for this run's activations: ComfyUI's estimate for the run's shape
        (`estimate`; the node's when None) times ACTIVATION_SAFETY."""
        return int((self.activation_bytes if estimate is None else estimate) * ACTIVATION_SAFETY)

    def overflow(self, activation, allocated, off_device):
        """Bytes by which activations + what is allocated + the ring of the units with weights off the device
        (`off_device`: {unit: bytes}) exceed the budget: what ComfyUI is to unload more (<= 0: it fits, or no
        cap)."""
        if not self.budget_bytes:
            return 0
        ring = ring_bytes([b for b in off_device.values() if b], self.prefetch_depth)
        return activation + allocated + ring - self.budget_bytes

    def after_load(self, activation, allocated, off_device):
        """(streamed units, promoted units, estimated peak bytes) once ComfyUI has loaded: of the units with
        weights off the device, what room the budget has left (less PROMOTE_MARGIN, the activations and what
        is allocated) takes the largest (`promote_blocks`), and the rest stream."""
        budget, depth = self.budget_bytes, self.prefetch_depth
        streamed = [n for n, b in off_device.items() if b]
        room = int(budget * (1 - PROMOTE_MARGIN)) - activation - allocated if budget else 0
        promoted = promote_blocks([(n, off_device[n]) for n in streamed], room, depth)
        streamed = [n for n in streamed if n not in promoted]
        peak = activation + allocated + sum(off_device[n] for n in promoted) + ring_bytes(
            [off_device[n] for n in streamed], depth)
        return streamed, promoted, peak


def place_run(plan, budget, streaming, comfy_reserve=None):
    """The placement of one sampling run at `budget` (the node's, or a retry's) from the node's `plan` (None:
    a pool without one: the default prefetch depth, no activation estimate). `streaming`: lowvram streaming
    runs, so the loader is shown `loader_budget`; otherwise the budget itself."""
    return RunPlacement(
        budget_bytes=budget,
        loader_bytes=loader_budget(plan, budget, comfy_reserve) if streaming else budget,
        prefetch_depth=plan.prefetch_depth if plan is not None else PREFETCH_DEPTH,
        activation_bytes=plan.activation_bytes if plan is not None else 0)
