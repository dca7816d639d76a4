"""Which steps of a sampling run are full steps, for each step-cache mode.

Modes: "off", "interval N" (the paper's uniform 1:N: steps 0, N, 2N, ...) and "non-uniform N" (its
non-uniform 1:N: as many full steps, ceil(T / N), packed densest around a center step and sparser away
from it, by a power law). The non-uniform rule, for T steps, k full steps, center c and power p:
    u_j = linspace(-c^(1/p), (T - c)^(1/p), k + 1),   i_j = floor(c + sign(u_j) |u_j|^p)
the distinct i_j without the first and the last, and step 0. Where rounding merges two of them, p is lowered
by 0.02 until k distinct steps remain; if p reaches 1 the uniform schedule is used. The center sits at a
quarter of the run: the early, noisy steps are where a step's deep features move most.
"""
import math

INTERVALS = (2, 3, 4, 5)
MODES = ("off",) + tuple("interval %d" % n for n in INTERVALS) + tuple("non-uniform %d" % n for n in INTERVALS)
CENTER = 0.25          # of the run's steps
POWER = 1.4
POWER_STEP = 0.02


def parse(mode):
    """(uniform, interval) of a mode string, or None for "off". Raises ValueError for an unknown mode."""
    if mode in (None, "", "off"):
        return None
    kind, _, n = str(mode).partition(" ")
    if kind not in ("interval", "non-uniform") or not n.isdigit() or int(n) < 2:
        raise ValueError("unknown step_cache mode %r (one of: %s)" % (mode, ", ".join(MODES)))
    return kind == "interval", int(n)


def full_steps(total, mode):
    """The sorted step indices (0 .. total-1) that run the whole UNet in a run of `total` sampler steps."""
    parsed = parse(mode)
    if parsed is None or total <= 0:
        return list(range(max(total, 0)))
    uniform, n = parsed
    if uniform:
        return list(range(0, total, n))
    return non_uniform(total, math.ceil(total / n)) or list(range(0, total, n))


def non_uniform(total, count, center=None, power=POWER):
    """The paper's non-uniform full steps (see the module doc), or None where no power above 1 gives
    `count` distinct steps."""
    c = total * CENTER if center is None else center
    if count <= 1:
        return [0]
    while power > 1:
        lo, hi = -(c ** (1 / power)), (total - c) ** (1 / power)
        points = [lo + (hi - lo) * j / count for j in range(count + 1)]
        steps = sorted({math.floor(c + math.copysign(abs(u) ** power, u) + 1e-9) for u in points})
        out = [0] + [s for s in steps[1:-1] if 0 < s < total]
        if len(out) == count:
            return out
        power -= POWER_STEP
    return None
