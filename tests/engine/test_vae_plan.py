"""engine/memory/vae_plan.py: when a VAE decode fits whole, which tiles otherwise, and the error below the floor."""
import pytest

from sd_accel.engine.memory import vae_plan

MIB = 2 ** 20
PER_PX = 2178 * 64 * 2          # ComfyUI's SD VAE estimate per latent pixel, fp16 (~0.27 MiB)
WEIGHTS = 160 * MIB


def test_fits_whole_when_weights_plus_activations_fit():
    need = WEIGHTS + PER_PX * 64 * 64
    p = vae_plan.plan_decode(64, 64, PER_PX, WEIGHTS, need)
    assert p.mode == "whole" and p.estimate_bytes == need


def test_tiles_are_the_largest_multiple_of_8_that_fits():
    budget = WEIGHTS + PER_PX * 64 * 64 - 1                 # 1024 px SDXL latent is 128x128; here 512 px: 64x64
    p = vae_plan.plan_decode(128, 128, PER_PX, WEIGHTS, budget)
    assert p.mode == "tiled" and p.tile == 56 and p.tile % 8 == 0
    assert WEIGHTS + PER_PX * p.tile ** 2 <= budget < WEIGHTS + PER_PX * (p.tile + 8) ** 2
    assert 2 <= p.overlap <= p.tile // 4
    assert "tiled: 448 px tiles" in p.summary()


def test_a_tile_never_exceeds_the_image():
    p = vae_plan.plan_decode(40, 24, PER_PX, WEIGHTS, WEIGHTS + PER_PX * 40 * 24 - 1)
    assert p.mode == "tiled" and p.tile <= 40


def test_below_the_smallest_tile_is_a_clear_error():
    with pytest.raises(vae_plan.DecodeTooLarge) as ei:
        vae_plan.plan_decode(128, 128, PER_PX, WEIGHTS, WEIGHTS + PER_PX * 15 * 15)
    assert ei.value.needed == WEIGHTS + PER_PX * 16 * 16 and "at least" in str(ei.value)
