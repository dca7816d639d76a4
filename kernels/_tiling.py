"""Integer arithmetic the launchers size their tiles and grids with."""


def cdiv(a, b):
    return -(-a // b)


def next_pow2(n):
    return 1 << max(0, int(n) - 1).bit_length()


def num_warps_for(tile_elems):
    """Warps for a memory-bound tile: about 16-32 elements per thread keeps enough loads in flight."""
    if tile_elems <= 2048:
        return 4
    if tile_elems <= 8192:
        return 8
    return 16
