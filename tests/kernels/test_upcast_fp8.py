"""upcast_fp8: a group of fp8 weights cast by one kernel into one buffer, each view equal to `weight.to(dtype)` (the
cast ComfyUI's manual cast makes at every call), channels_last conv weights and tensors spanning several tiles
included; every element the views do not cover is left alone."""
import pytest
import torch

from sd_accel.kernels import upcast_fp8 as k

FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3")] + \
    ([pytest.param(torch.float8_e5m2, id="e5m2")] if hasattr(torch, "float8_e5m2") else [])
DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float32, id="fp32")]


def _weights(fp8, device):
    g = torch.Generator().manual_seed(0)
    conv = (torch.randn(40, 24, 3, 3, generator=g) * 4).to(fp8)           # 8640 elements: three tiles
    conv_cl = (torch.randn(16, 8, 3, 3, generator=g) * 100).to(fp8).contiguous(memory_format=torch.channels_last)
    linear = (torch.randn(33, 17, generator=g) / 50).to(fp8)                # small and subnormal values
    one = torch.tensor([448.0 if fp8 == torch.float8_e4m3fn else 57344.0]).to(fp8)   # the format's largest
    return [t.to(device) for t in (conv, conv_cl, linear, one)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", FP8)
def test_each_view_is_the_weights_cast(fp8, dtype, device, poison_empty):
    sources = _weights(fp8, device)
    assert k.sources_ineligible(sources) is None
    layout = k.Layout([t.numel() for t in sources], device)
    dst = torch.full((layout.total,), -7.0, dtype=dtype, device=device)
    out = k.upcast_fp8(sources, dst, layout, k.pointer_table(sources, device))
    assert k.upcast_fp8.last_call.path == "triton", k.upcast_fp8.last_call.reason
    assert out is dst
    covered = torch.zeros(layout.total, dtype=torch.bool, device=device)
    for i, t in enumerate(sources):
        v = layout.view(dst, i, t)
        assert v.shape == t.shape and v.stride() == t.stride()
        assert torch.equal(v, t.to(dtype)), i
        assert v.data_ptr() % 16 == 0
        covered[layout.starts[i]:layout.starts[i] + t.numel()] = True
    assert bool((dst[~covered] == -7.0).all()), "the kernel wrote outside the sources' slices"


def test_the_slices_start_at_tile_boundaries_and_follow_each_other():
    layout = k.Layout([1, k.BLOCK, k.BLOCK + 1, 5], "cpu")
    assert layout.starts == (0, k.BLOCK, 2 * k.BLOCK, 4 * k.BLOCK)
    assert layout.total == 5 * k.BLOCK
    assert layout.tile_source.tolist() == [0, 1, 2, 2, 3]


def test_sources_the_kernel_cannot_read_are_refused_with_a_reason():
    a = torch.zeros(64, dtype=torch.float8_e4m3fn)
    assert "dtype" in k.sources_ineligible([a, torch.zeros(64, dtype=torch.float16)])
    assert "dense" in k.sources_ineligible([a[::2]])
    assert "aligned" in k.sources_ineligible([a[1:33]])
    if hasattr(torch, "float8_e5m2"):
        assert "one fp8 dtype" in k.sources_ineligible([a, torch.zeros(64, dtype=torch.float8_e5m2)])


def test_the_reference_casts_the_same(device):
    sources = _weights(torch.float8_e4m3fn, device)
    layout = k.Layout([t.numel() for t in sources], device)
    dst = torch.zeros(layout.total, dtype=torch.float16, device=device)
    k.upcast_fp8_reference(sources, dst, layout)
    for i, t in enumerate(sources):
        assert torch.equal(layout.view(dst, i, t), t.half())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", FP8)
def test_every_fp8_code_decodes_to_its_value(fp8, dtype, device):
    """All 256 codes (subnormals, the largest values, infinities and NaNs), decoded from their bits, in a whole tile
    (loaded unmasked) and in a source's last, partial one."""
    n = k.BLOCK + 256 + 16
    codes = torch.arange(n, dtype=torch.int64).remainder(256).to(torch.uint8).view(fp8).to(device)
    layout = k.Layout([n], device)
    dst = torch.zeros(layout.total, dtype=dtype, device=device)
    k.upcast_fp8([codes], dst, layout, k.pointer_table([codes], device))
    assert k.upcast_fp8.last_call.path == "triton", k.upcast_fp8.last_call.reason
    assert torch.equal(dst[n:], torch.zeros_like(dst[n:]))       # nothing written past the source's last code
    got, want = dst[:n], codes.to(dtype)
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(got[finite].signbit(), want[finite].signbit())    # -0.0 stays negative
