"""Whether a VAE decode fits a memory budget whole, or in tiles of which size. Pure: numbers in, a plan out.

A decode's activation memory grows with the latent's area (ComfyUI's own estimate, `memory_used_decode`, is
linear in latent height x width for image VAEs). The decode fits whole when weights + one image's
activations fit the budget; otherwise it runs in square tiles, the largest whose activations (tile area,
overlap included) fit next to the weights. Stock ComfyUI only tiles after an out-of-memory error, and at
a fixed tile size; planning first avoids the failed attempt (and on a shared card, the other program's
out-of-memory).
"""
import math
from dataclasses import dataclass

GIB = 2 ** 30
MIN_TILE = 16       # latent pixels (128 image pixels for SD's 8x VAE): below this the seams dominate
TILE_STEP = 8       # tile edges in multiples of 8 latent pixels


class DecodeTooLarge(ValueError):
    def __init__(self, needed, given):
        self.needed, self.given = int(needed), int(given)
        super().__init__("VAE decode needs at least %.2f GiB (its weights plus the smallest tile, %d latent px), "
                         "the budget is %.2f GiB" % (self.needed / GIB, MIN_TILE, self.given / GIB))


@dataclass
class DecodePlan:
    mode: str            # "whole" or "tiled"
    tile: int = 0        # tile edge in latent pixels (tiled)
    overlap: int = 0     # latent pixels shared by neighbouring tiles (tiled)
    estimate_bytes: int = 0
    budget_bytes: int = 0

    def summary(self):
        est = "%.2f GiB needed whole, budget %.2f GiB" % (self.estimate_bytes / GIB, self.budget_bytes / GIB)
        if self.mode == "whole":
            return "VAE decode whole (%s)" % est
        return "VAE decode tiled: %d px tiles, %d px overlap (%s)" % (self.tile * 8, self.overlap * 8, est)


def plan_decode(latent_h, latent_w, bytes_per_latent_px, weight_bytes, budget_bytes):
    """`bytes_per_latent_px`: activation bytes one latent pixel of one image costs (the host's estimate
    divided by the area). `budget_bytes`: what the decode may use, weights included."""
    per_px, weights, budget = float(bytes_per_latent_px), int(weight_bytes), int(budget_bytes)
    whole = weights + per_px * latent_h * latent_w
    if whole <= budget:
        return DecodePlan("whole", estimate_bytes=int(whole), budget_bytes=budget)
    room = budget - weights
    side = int(math.sqrt(room / per_px)) if room > 0 and per_px > 0 else 0
    side = side // TILE_STEP * TILE_STEP
    if side < MIN_TILE:
        raise DecodeTooLarge(weights + per_px * MIN_TILE * MIN_TILE, budget)
    side = min(side, max(latent_h, latent_w))
    overlap = max(2, min(16, side // 4))
    return DecodePlan("tiled", tile=side, overlap=overlap, estimate_bytes=int(whole), budget_bytes=budget)
