"""group_norm_silu against torch's GroupNorm + SiLU computed in fp32 from the same (upcast) inputs, through
both Triton paths: one program per (sample, group) where a group fits one tile, and the split
statistics + apply launches (forced on every shape by the `plan` fixture's "split")."""
import pytest
import torch

from sd_accel.kernels import _device, _triton
from sd_accel.kernels import _group_norm_tiling as tiling
from sd_accel.kernels import group_norm_silu as gn
from sd_accel.kernels.group_norm_silu import eligible, group_norm_silu, group_norm_silu_reference

CL = torch.channels_last

# Real SD shapes with the spatial size scaled down for the interpreter, plus odd cases.
SHAPES = [
    pytest.param((2, 320, 8, 8), id="sd15-320"),
    pytest.param((2, 640, 4, 4), id="sd15-640"),
    pytest.param((1, 960, 6, 5), id="sd15-960-odd-hw"),
    pytest.param((1, 1280, 2, 2), id="sd15-1280"),
    pytest.param((1, 2560, 2, 1), id="sd15-2560"),
    pytest.param((1, 64, 45, 45), id="multi-chunk"),   # several spatial tiles and chunks, last ones short
    pytest.param((3, 96, 1, 1), id="hw1"),
    pytest.param((1, 160, 7), id="ncl-odd-L"),
]
DTYPES = [
    pytest.param(torch.float32, 2e-5, 2e-5, id="fp32"),
    pytest.param(torch.float16, 2e-3, 2e-3, id="fp16"),
    pytest.param(torch.bfloat16, 1e-2, 1e-2, id="bf16"),
]


def _inputs(shape, dtype, device, channels_last=False, w_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = shape[1]
    # per-channel offsets and scales so groups have distinct, non-trivial statistics
    offs = torch.randn(C, generator=g).view(1, C, *([1] * (len(shape) - 2))) * 2
    x = (torch.randn(shape, generator=g) * 1.5 + offs).to(device=device, dtype=dtype)
    if channels_last:
        x = x.to(memory_format=CL)
    w = torch.randn(C, generator=g).to(device=device, dtype=w_dtype or dtype)
    b = torch.randn(C, generator=g).to(device=device, dtype=w_dtype or dtype)
    return x, w, b


@pytest.fixture(params=["auto", "split"])
def plan(request, monkeypatch):
    """"auto": the path the sizes pick (one program per group for most test shapes); "split": the
    statistics + apply launches, whatever the size."""
    if request.param == "split":
        monkeypatch.setattr(tiling, "ONE_TILE_MAX", 0)
    return request.param


def _fp32_reference(x, w, b, eps=1e-5, activation="silu"):
    up = lambda t: None if t is None else t.float()
    return group_norm_silu_reference(x.float(), 32, up(w), up(b), eps, activation)


def _check(y, x, ref, atol, rtol, plan=None):
    assert group_norm_silu.last_call.path == "triton", group_norm_silu.last_call.reason
    if plan == "split":
        assert group_norm_silu.last_call.plan == "split"
    assert y.dtype == x.dtype and y.shape == x.shape
    if x.dim() == 4 and not x.is_contiguous():
        assert y.is_contiguous(memory_format=CL)
    else:
        assert y.is_contiguous()
    assert not torch.isnan(y).any()
    torch.testing.assert_close(y.float(), ref, atol=atol, rtol=rtol)


# every shape contiguous, and every 4-D shape channels_last too
LAYOUTS = [pytest.param(p.values[0], False, id=p.id + "-nchw") for p in SHAPES] + [
    pytest.param(p.values[0], True, id=p.id + "-cl") for p in SHAPES if len(p.values[0]) == 4]


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("shape, channels_last", LAYOUTS)
def test_group_norm_silu(shape, channels_last, dtype, atol, rtol, device, poison_empty, plan):
    x, w, b = _inputs(shape, dtype, device, channels_last)
    y = group_norm_silu(x, 32, w, b, 1e-5)
    _check(y, x, _fp32_reference(x, w, b), atol, rtol, plan)


@pytest.mark.parametrize(
    "x_dtype, w_dtype, affine, activation, channels_last",
    [
        pytest.param(torch.float16, torch.float32, "wb", "silu", False, id="fp32-weight-fp16-x"),
        pytest.param(torch.bfloat16, torch.float32, "wb", "silu", True, id="fp32-weight-bf16-x-cl"),
        pytest.param(torch.float16, None, "", "silu", True, id="no-affine-cl"),
        pytest.param(torch.float32, None, "w", "silu", False, id="weight-only"),
        pytest.param(torch.float32, None, "b", None, False, id="bias-only-no-act"),
        pytest.param(torch.float16, None, "wb", None, True, id="no-act-cl"),
    ],
)
def test_affine_and_activation(x_dtype, w_dtype, affine, activation, channels_last, device, poison_empty):
    x, w, b = _inputs((2, 320, 4, 6), x_dtype, device, channels_last, w_dtype, seed=1)
    w = w if "w" in affine else None
    b = b if "b" in affine else None
    y = group_norm_silu(x, 32, w, b, 1e-6, activation=activation)
    tol = 2e-5 if x_dtype == torch.float32 else 1e-2
    _check(y, x, _fp32_reference(x, w, b, 1e-6, activation), tol, tol)


@pytest.mark.parametrize("shape, channels_last", [
    pytest.param((2, 320, 8, 8), False, id="nchw"), pytest.param((2, 320, 8, 8), True, id="cl"),
    pytest.param((1, 64, 45, 45), True, id="multi-chunk-cl"), pytest.param((2, 160, 7), False, id="ncl")])
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_add_per_sample_and_channel_is_folded_into_the_norm(shape, channels_last, dtype, atol, rtol, device,
                                                             poison_empty, plan):
    """GroupNorm(x + add) for a ResBlock's conv bias + timestep embedding: the add varies across the
    channels of a group (so it moves the group's variance, not just its mean) and across samples."""
    x, w, b = _inputs(shape, dtype, device, channels_last, seed=3)
    g = torch.Generator().manual_seed(4)
    add = (torch.randn(shape[:2], generator=g) * 3).to(device)
    y = group_norm_silu(x, 32, w, b, 1e-5, add=add)
    ref = group_norm_silu_reference(x.float(), 32, w.float(), b.float(), 1e-5, "silu", add.float())
    _check(y, x, ref, atol, rtol, plan)
    y1 = group_norm_silu(x, 32, w, b, 1e-5, add=add[0])          # a [C] add, the same for every sample
    _check(y1, x, group_norm_silu_reference(x.float(), 32, w.float(), b.float(), 1e-5, "silu",
                                            add[0].float()), atol, rtol, plan)
    # the columns of a wider tensor (engine/patches/emb_projections.py hands each ResBlock its slice): read in place
    wide = torch.zeros(shape[0], shape[1] + 40, device=device)
    wide[:, 17:17 + shape[1]] = add
    y2 = group_norm_silu(x, 32, w, b, 1e-5, add=wide[:, 17:17 + shape[1]])
    assert torch.equal(y2, y)


def test_an_add_of_the_wrong_shape_falls_back_with_a_reason(device):
    x, w, b = _inputs((2, 320, 4, 4), torch.float32, device)
    add = torch.randn(2, 320, 4, 4, device=device)          # not one value per (sample, channel)
    y = group_norm_silu(x, 32, w, b, add=add)
    assert group_norm_silu.last_call.path == "reference" and "add" in group_norm_silu.last_call.reason
    torch.testing.assert_close(y, torch.nn.functional.silu(torch.nn.functional.group_norm(x + add, 32, w, b)))


def test_large_mean_small_std(device, plan):
    # mean 1000, std 0.01: E[x^2] - E[x]^2 in fp32 would lose the variance entirely here; torch's own
    # fp32 GroupNorm is off by ~6e-3 against fp64 on this input
    g = torch.Generator().manual_seed(2)
    x = (1000 + 0.01 * torch.randn(1, 64, 40, 40, generator=g, dtype=torch.float64)).float()
    ref = group_norm_silu_reference(x.double(), 32, activation=None).float()
    y = group_norm_silu(x.to(device), 32, activation=None)
    assert group_norm_silu.last_call.path == "triton"
    torch.testing.assert_close(y.cpu(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "cl"])
def test_groups_other_than_32(device, plan, channels_last):
    for C, groups in ((48, 1), (48, 3), (48, 48), (160, 1), (96, 2)):   # 160 / 1: a group wider than a tile
        x, w, b = _inputs((2, C, 5, 5), torch.float32, device, channels_last, seed=3)
        y = group_norm_silu(x, groups, w, b)
        assert group_norm_silu.last_call.path == "triton"
        torch.testing.assert_close(y, group_norm_silu_reference(x, groups, w, b), atol=2e-5, rtol=2e-5)


# ---- which path, and the split path's corners ----

@pytest.mark.parametrize("shape, one_program", [
    ((2, 1280, 8, 8), True), ((2, 2560, 8, 8), True), ((2, 640, 16, 16), True), ((8, 640, 16, 16), True),
    ((2, 1280, 16, 16), False), ((2, 1920, 16, 16), False), ((2, 320, 32, 32), False),
    ((2, 2560, 16, 16), False), ((2, 640, 32, 32), False), ((2, 960, 32, 32), False), ((2, 320, 64, 64), False),
    ((8, 320, 64, 64), False)])
def test_which_path_sd15_512_shapes_take(shape, one_program):
    """SD1.5 512²'s 8² level and 16² up to 640 channels are one launch; the rest the split path (two
    launches; measured faster from 16384 lanes up). The batch does not matter."""
    N, C, H, W = shape
    assert gn.one_program_per_group(C, H * W, 32) is one_program


@pytest.mark.parametrize("C, width", [(320, 32), (640, 64), (1280, 128), (2560, 32), (960, 32), (64, 32)])
def test_channels_last_rows_are_the_width_that_pads_least(C, width, device, monkeypatch):
    """32 groups: 320 channels in tiles of 3 groups (30 of 32 lanes), 640 likewise in 64, 1280 in 128; 2560
    (80 a group) in three parts of 32. Each width computes the norm right (split path forced)."""
    assert tiling.cl_target_c(C // 32, 32) == width
    monkeypatch.setattr(tiling, "ONE_TILE_MAX", 0)
    x, w, b = _inputs((1, C, 3, 5), torch.float32, device, True, seed=9)
    y = group_norm_silu(x, 32, w, b)
    assert tiling.split_config(1, C, 15, 32, True, _device.sm_count(x.device))[1] == width   # block_c
    _check(y, x, group_norm_silu_reference(x, 32, w, b), 2e-5, 2e-5, "split")


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "cl"])
def test_both_sides_of_the_one_program_threshold(device, monkeypatch, channels_last):
    """A lowered threshold, so that both sides run in the interpreter: 10 channels per group (16 lanes)
    x 8x8 (64) fits 1024 lanes, x 8x16 does not."""
    monkeypatch.setattr(tiling, "ONE_TILE_MAX", 1024)
    for shape, expect in (((2, 320, 8, 8), "one program per group"), ((2, 320, 8, 16), "split")):
        x, w, b = _inputs(shape, torch.float16, device, channels_last, seed=6)
        y = group_norm_silu(x, 32, w, b)
        assert group_norm_silu.last_call.plan == expect
        _check(y, x, _fp32_reference(x, w, b), 2e-3, 2e-3)


@pytest.mark.parametrize("shape, channels_last", [
    pytest.param((1, 320, 17, 17), False, id="nchw-groups-in-parts"),   # 10 channels, tiles of 2: J = 5
    pytest.param((2, 320, 19, 23), True, id="cl-odd"), pytest.param((1, 64, 45, 45), True, id="cl-multi-chunk")])
def test_split_path_merging_in_several_steps_and_tile_runs(shape, channels_last, device, monkeypatch, poison_empty):
    """The apply kernel merges the partials a few at a time (small MERGE_BLOCK) and runs over several
    spatial tiles per program (a device of one SM leaves it room), with a short last run; with an add."""
    monkeypatch.setattr(tiling, "ONE_TILE_MAX", 0)
    monkeypatch.setattr(tiling, "MERGE_BLOCK", 4)
    monkeypatch.setattr(gn, "sm_count", lambda device: 1)
    monkeypatch.setattr(tiling, "CL_TARGET_C", 128)   # rows of 128 channels: several short runs of spatial tiles
    block_s, block_c, K, KB, J, c_tiles, s_tiles, chunk_iters, nsc, apply_iters, block_p = tiling.split_config(
        shape[0], shape[1], shape[2] * shape[3], 32, channels_last, sms=1)
    assert nsc * J > block_p                        # the merge takes several steps
    assert (J > 1) if not channels_last else (apply_iters > 1 and s_tiles % apply_iters), (J, s_tiles, apply_iters)
    x, w, b = _inputs(shape, torch.float32, device, channels_last, seed=7)
    add = torch.randn(shape[:2], generator=torch.Generator().manual_seed(8)).to(device) * 2
    y = group_norm_silu(x, 32, w, b, add=add)
    ref = group_norm_silu_reference(x, 32, w, b, 1e-5, "silu", add)
    _check(y, x, ref, 2e-5, 2e-5, "split")


# ---- fallbacks: never mistaken for the kernel, same result (or error) as the reference ----

def _assert_fallback(x, groups=32, w=None, b=None, reason=None):
    ok, why = eligible(x, groups, w, b)
    assert not ok and why and (reason is None or reason in why), why
    y = group_norm_silu(x, groups, w, b)
    assert group_norm_silu.last_call.path == "reference" and group_norm_silu.last_call.reason == why
    torch.testing.assert_close(y, group_norm_silu_reference(x, groups, w, b))
    return y


def test_fallback_fp64(device):
    x, w, b = _inputs((1, 64, 3, 3), torch.float64, device)
    _assert_fallback(x, 32, w, b, "dtype")


def test_fallback_integer_dtype_raises_like_reference(device):
    x = torch.ones(1, 64, 2, 2, dtype=torch.int32, device=device)
    assert eligible(x, 32) == (False, "dtype torch.int32")
    with pytest.raises(RuntimeError):
        group_norm_silu_reference(x, 32)
    with pytest.raises(RuntimeError):
        group_norm_silu(x, 32)
    assert group_norm_silu.last_call.path == "reference"


def test_fallback_groups_not_dividing_channels(device):
    x, w, b = _inputs((1, 60, 2, 2), torch.float32, device)
    ok, why = eligible(x, 32, w, b)
    assert not ok and "divisible" in why
    with pytest.raises(RuntimeError):
        group_norm_silu(x, 32, w, b)


def test_fallback_cpu_tensor_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w, b = _inputs((1, 64, 3, 3), torch.float32, "cpu")
    _assert_fallback(x, 32, w, b, "CPU tensor")


def test_fallback_cpu_keeps_channels_last(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w, b = _inputs((1, 64, 3, 3), torch.float16, "cpu", channels_last=True)
    y = group_norm_silu(x, 32, w, b)
    assert group_norm_silu.last_call.path == "reference" and y.is_contiguous(memory_format=CL)


def test_fallback_no_triton(monkeypatch, device):
    monkeypatch.setattr(_triton, "get_triton", lambda: None)
    x, w, b = _inputs((1, 64, 3, 3), torch.float32, device)
    _assert_fallback(x, 32, w, b, "no Triton")


def test_fallback_old_gpu(monkeypatch):
    if not torch.cuda.is_available():   # the refusal itself is covered on CPU in test_triton_runnable.py
        pytest.skip("needs a CUDA tensor: checks the fallback's output on the GPU")
    monkeypatch.setattr(_device, "capability", lambda device: (6, 1))
    x, w, b = _inputs((1, 64, 3, 3), torch.float16, "cuda")
    _assert_fallback(x, 32, w, b, "sm_61 < sm_70")


@pytest.mark.parametrize(
    "case",
    ["strided", "autograd", "weight-wrong-size", "3d-transposed"],
)
def test_fallback_other(case, device):
    x, w, b = _inputs((1, 64, 4, 4), torch.float32, device)
    if case == "strided":
        x = x[:, :, ::2]
    elif case == "autograd":
        x.requires_grad_(True)
    elif case == "weight-wrong-size":
        w = torch.ones(32, device=device)
        with pytest.raises(RuntimeError):
            group_norm_silu(x, 32, w, b)
        assert not eligible(x, 32, w, b)[0]
        return
    elif case == "3d-transposed":
        x = x.flatten(2).transpose(1, 2).contiguous().transpose(1, 2)
    _assert_fallback(x, 32, w, b)


def test_bad_activation(device):
    x, w, b = _inputs((1, 64, 2, 2), torch.float32, device)
    with pytest.raises(ValueError):
        group_norm_silu(x, 32, w, b, activation="gelu")


def test_cuda_graph_capture():
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU")
    x, w, b = _inputs((2, 320, 16, 16), torch.float16, "cuda", channels_last=True)
    group_norm_silu(x, 32, w, b)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = group_norm_silu(x, 32, w, b)
    x.copy_(torch.randn_like(x) * 3 + 1)
    graph.replay()
    torch.testing.assert_close(y.float(), _fp32_reference(x, w, b), atol=2e-3, rtol=2e-3)
