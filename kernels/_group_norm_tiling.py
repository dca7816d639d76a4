"""group_norm_silu's choice of path and the split path's tiling: plain integer arithmetic over the sizes,
with the constants bench/tune_group_norm.py sweeps (it sets them on this module).

The constants come from that sweep over the GroupNorms of an SD1.5 forward, replayed from a CUDA graph
(bench/RESULTS.md has its figures); the grids are sized by the device's SM count.
"""
from ._tiling import cdiv, next_pow2

ONE_TILE_MAX = 8192     # lanes (powers of two of CG and HW) one program loads at once. 16384 would fit in
                        # registers (16 warps, no spill on sm_90), but from there up the split path is the
                        # faster, and one program per group still the faster at 8192
MAX_CHUNKS = 64         # spatial chunks per batch item in the split path's statistics
MERGE_MAX = 512         # partials (chunks x group parts x group slots) one apply program merges
MERGE_BLOCK = 512       # of which it loads at most this many per step
MAX_TILE_GROUPS = 16    # whole groups per channel tile
TILE = 2048             # elements per program tile (2048 beats 4096 and 8192 on channels_last)
CL_TARGET_C = None      # channels_last: channels per tile row (contiguous); None: cl_target_c picks
WARPS = None            # split path's warps per program; None: num_warps_for(tile)


def one_program_per_group(C, HW, num_groups):
    """True when `_gn_group_kernel` (one launch, one program per (sample, group)) takes these sizes."""
    return next_pow2(HW) * next_pow2(C // num_groups) <= ONE_TILE_MAX


def channel_tiles(CG, G, target_c):
    """(K, J, block_c, c_tiles) for channel tiles of about `target_c` lanes: K whole groups a tile, or (K == 1)
    one of J parts of a group wider than the tile."""
    if CG <= target_c:
        K = min(max(1, target_c // CG), MAX_TILE_GROUPS, G)
        J, block_c = 1, max(2, next_pow2(K * CG))
    else:
        K, J, block_c = 1, cdiv(CG, target_c), target_c
    return K, J, block_c, cdiv(G, K) * J


def cl_target_c(CG, G):
    """channels_last: the row width (32, 64 or 128 channels) whose tiles waste the fewest lanes on padding,
    the narrower on a tie. The sweep found that width the fastest for each channel count of an SD1.5
    forward (320: 32, 640: 64, 1280: 128, 2560: 32), up to twice as fast as a fixed 128."""
    if CL_TARGET_C:
        return CL_TARGET_C
    best = None
    for target in (32, 64, 128):
        _, _, block_c, c_tiles = channel_tiles(CG, G, target)
        waste = c_tiles * block_c
        if best is None or waste < best[0]:
            best = (waste, target)
    return best[1]


def split_config(N, C, HW, G, channels_last, sms):
    """The split path's tiling on a device of `sms` SMs: (block_s, block_c, K, KB, J, c_tiles, s_tiles,
    chunk_iters, nsc, apply_iters, block_p). Channel tiles hold K whole groups, or (K == 1) one of J parts
    of a group."""
    CG = C // G
    # a small tensor gets smaller tiles, so that there are programs for every SM
    tile = max(1024, min(TILE, next_pow2(N * C * HW // (4 * sms))))
    if channels_last:
        # rows of 32-128 contiguous channels (64-256 B in fp16)
        target_c, block_s = cl_target_c(CG, G), None
    else:
        block_s = max(2, min(next_pow2(HW), 1024, tile))
        target_c = max(2, tile // block_s)
    K, J, block_c, c_tiles = channel_tiles(CG, G, target_c)
    KB = max(2, next_pow2(K))
    if block_s is None:
        block_s = max(2, min(max(1, tile // block_c), next_pow2(HW)))
    s_tiles = cdiv(HW, block_s)
    chunk_iters = cdiv(s_tiles, max(1, min(MAX_CHUNKS, MERGE_MAX // (J * KB))))
    nsc = cdiv(s_tiles, chunk_iters)
    block_p = max(2, min(next_pow2(nsc * J), max(2, MERGE_BLOCK // KB)))
    # a few tiles per apply program so that its merge (about 3 * nsc * J * KB loads) stays a small
    # share of its work, while the grid still covers the SMs twice
    want = cdiv(4 * 3 * nsc * J * KB, block_s * block_c)
    room = max(1, (s_tiles * c_tiles * N) // (2 * sms))
    apply_iters = max(1, min(want, room, s_tiles))
    return block_s, block_c, K, KB, J, c_tiles, s_tiles, chunk_iters, nsc, apply_iters, block_p
