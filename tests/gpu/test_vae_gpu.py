"""GPU only: Apply SD Accel (VAE)'s copy of a VAE (hosts/comfyui/vae_accel.py) against ComfyUI's own VAE, in-process
on ComfyUI's default allocator. Two comfy.sd.VAE objects of the same random full-size weights (dev/fixtures.
random_vae), one stock and one accelerated, so the copy's channels_last weights never reach the stock side.

Checks: the fused decode and encode equal stock's within bf16/fp16 noise; the calls replay CUDA graphs, a second
shape captures its own and the first shape's graph still replays; a tiled decode keeps one graph per tile shape;
the decode's peak allocated memory is not above stock's; ComfyUI unloading the VAE frees the graphs and the driver
gives their memory back to the device. On a ComfyUI
without ON_DETACH callbacks (2024) no graph is kept, and the report says so."""
import re

import pytest
import torch

from test_graphs_gpu import COMFY, comfy_env  # noqa: F401  (the shared module fixture: ComfyUI booted as main.py)

MIN_PSNR = 45.0
GIB = float(2 ** 30)


@pytest.fixture(scope="module")
def vaes(comfy_env):  # noqa: F811
    import fixtures
    from sd_accel.hosts.comfyui import vae_accel
    stock = fixtures.random_vae(COMFY, seed=31)
    base = fixtures.random_vae(COMFY, seed=31)
    acc, info = vae_accel.accelerate_vae(base)
    assert acc is not base and set(info["reasons"]) == (set() if _graphs_kept() else {"cuda_graph"}), info["reasons"]
    return stock, acc, info


def _psnr(a, b):
    mse = float(((a.float() - b.float()) ** 2).mean())
    return 99.0 if mse == 0 else 10 * torch.log10(torch.tensor(1.0 / mse)).item()


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _latent(side, batch=1, seed=3):
    return torch.randn(batch, 4, side // 8, side // 8, generator=torch.Generator().manual_seed(seed))


def _graphs_kept():
    import comfy.model_patcher as mp
    return hasattr(mp.ModelPatcher, "add_callback_with_key")


def _calls(vae, info, fn, n):
    """(last output, report) of `n` calls of fn(vae) measured as one accelerated run."""
    from sd_accel.hosts.comfyui import vae_accel
    out, rep = None, {}
    with torch.inference_mode(), vae_accel.measured(info, rep):
        for _ in range(n):
            out = fn(vae)
    return out, rep


def _graph_counts(rep, method):
    """(replays, captures) of `method` in the report's "ran" list, (0, 0) where it has none."""
    m = re.search(r"cuda_graph %s \((\d+) replays, (\d+) captures\)" % method, ", ".join(rep["ran"]))
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _expect(rep, method, min_replays, captures):
    assert "fused kernels x" in ", ".join(rep["ran"]), rep
    if _graphs_kept():
        replays, got = _graph_counts(rep, method)
        assert replays >= min_replays and got == captures, rep
    else:
        assert any("no ON_DETACH callbacks" in why for why in rep["fell_back"].values()), rep


def test_decode_equals_stock_and_each_shape_replays_its_own_graph(vaes):
    stock, acc, info = vaes
    graphs = info["forwards"]["decode"].graphs
    for side in (512, 768):
        with torch.inference_mode():
            ref = stock.decode(_latent(side))
        # warm-up (a finding of the first may be checked on a second), capture, replays
        out, rep = _calls(acc, info, lambda v: v.decode(_latent(side)), 4)
        assert _psnr(out, ref) >= MIN_PSNR and _rel(out, ref) < 1e-2, (side, _psnr(out, ref), rep["line"])
        _expect(rep, "decode", 2, 1)
    again, rep = _calls(acc, info, lambda v: v.decode(_latent(512)), 1)
    _expect(rep, "decode", 1, 0)   # the 512² graph survived the 768² capture
    if _graphs_kept():
        assert len(graphs.entries) == 2


def test_a_batch_of_four_decodes_as_stock_does(vaes):
    stock, acc, info = vaes
    with torch.inference_mode():
        ref = stock.decode(_latent(512, batch=4))
    out, rep = _calls(acc, info, lambda v: v.decode(_latent(512, batch=4)), 3)
    assert out.shape == ref.shape and _psnr(out, ref) >= MIN_PSNR, (_psnr(out, ref), rep["line"])


def test_between_decodes_the_weights_are_in_stock_s_layout_and_vae_save_works(vaes, tmp_path):
    """Each decode runs on channels_last conv weights and returns them in stock's layout (the user's VAE's weights:
    VAE Save reads them unloaded, and safetensors refuses non-contiguous tensors); the next decode converts them
    again and still replays its graph, equal to stock. ComfyUI 2024 (no ON_DETACH callbacks): no channels_last at
    all, and the save works the same."""
    import comfy.utils
    stock, acc, info = vaes
    with torch.inference_mode():
        ref = stock.decode(_latent(512))
    for _ in range(4):   # run alone: warm-up (a finding of the first may be checked on a second), capture, replay
        out, rep = _calls(acc, info, lambda v: v.decode(_latent(512)), 1)
        assert ("channels_last (decode)" in rep["ran"]) == _graphs_kept(), rep
        assert _psnr(out, ref) >= MIN_PSNR, (_psnr(out, ref), rep["line"])
        sd = acc.get_sd()
        assert all(t.is_contiguous() for t in sd.values()), [k for k, t in sd.items() if not t.is_contiguous()]
        comfy.utils.save_torch_file(sd, str(tmp_path / "vae.safetensors"))
    _expect(rep, "decode", 1, 0)


def test_a_tiled_decode_keeps_one_graph_per_tile_shape(vaes):
    stock, acc, info = vaes
    tiling = {"tile_x": 64, "tile_y": 64, "overlap": 8}   # VAE Decode (Tiled)'s defaults
    lat = _latent(1024, seed=5)
    with torch.inference_mode():
        ref = stock.decode_tiled(lat, **tiling)
    _calls(acc, info, lambda v: v.decode_tiled(lat, **tiling), 3)   # every shape probed, then captured
    tiles = []
    hook = acc.first_stage_model.decoder.register_forward_pre_hook(lambda m, a: tiles.append(tuple(a[0].shape)))
    try:
        out, rep = _calls(acc, info, lambda v: v.decode_tiled(lat, **tiling), 1)
    finally:
        hook.remove()
    assert _psnr(out, ref) >= MIN_PSNR, (_psnr(out, ref), rep["line"])
    assert len(set(tiles)) > 1, "edge tiles of other shapes"
    if _graphs_kept():
        assert _graph_counts(rep, "decode") == (len(tiles), 0), (len(tiles), rep)   # every tile replayed


def test_encode_equals_stock_and_replays(vaes):
    stock, acc, info = vaes
    pixels = torch.rand(1, 512, 512, 3, generator=torch.Generator().manual_seed(8))

    def encode(v):
        torch.manual_seed(0)   # ComfyUI 2024 samples the latent from the global generator
        return v.encode(pixels)
    import fixtures
    exact = fixtures.random_vae(COMFY, seed=31, dtype=torch.float32)
    with torch.inference_mode():
        ref = encode(stock)
        ref32 = encode(exact)
    del exact
    out, rep = _calls(acc, info, encode, 4)
    # the encoder's latent moves with the VAE's own low-precision rounding (bf16 on recent GPUs: ~2e-2 on random
    # weights), so ours is held to stock's own distance from an fp32 encode, not to a fixed bound
    stock_err, ours_err = _rel(ref, ref32), _rel(out, ref32)
    assert ours_err <= 1.5 * stock_err + 1e-3, (ours_err, stock_err, _rel(out, ref), stock.vae_dtype, rep["line"])
    _expect(rep, "encode", 2, 1)


def _peak(fn, calls, fresh=None):
    """Peak allocated GiB over calls 2..n of fn (the first loads the weights and compiles kernels ahead), and the
    driver's graph memory they added. `fresh()`: run after the unload, so that ours probes again and captures
    inside the measured calls."""
    import comfy.model_management as mm
    from sd_accel.engine.graphs import graph_memory
    mm.unload_all_models()
    mm.soft_empty_cache()
    if fresh is not None:
        fresh()
    with torch.inference_mode():
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        graph0 = graph_memory.reserved_bytes() or 0
        for _ in range(calls - 1):
            fn()
        torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / GIB, ((graph_memory.reserved_bytes() or 0) - graph0) / GIB


def test_the_1024_decode_s_peak_memory_is_not_above_stock_s(vaes):
    stock, acc, info = vaes
    lat = _latent(1024, seed=9)
    graphs = info["forwards"]["decode"].graphs
    stock_peak, _ = _peak(lambda: stock.decode(lat), 3)
    captures = graphs.stats["captures"]
    ours_peak, ours_graph = _peak(lambda: acc.decode(lat), 3, fresh=graphs.verdicts.clear)   # probe, capture, replay
    if _graphs_kept():
        assert graphs.stats["captures"] == captures + 1 and graphs.entries, "the 1024² decode kept a graph"
    # the capture's allocations in torch's count; where they only show as the driver's graph memory, that too
    assert ours_peak <= stock_peak * 1.02 and ours_graph <= stock_peak * 1.02, (ours_peak, ours_graph, stock_peak)


def test_comfyui_unloading_the_vae_frees_its_graphs_and_gives_their_memory_back(vaes):
    import comfy.model_management as mm
    from sd_accel.engine.graphs import graph_memory
    stock, acc, info = vaes
    graphs = info["forwards"]["decode"].graphs
    mm.unload_all_models()
    base = graph_memory.reserved_bytes()
    assert base is not None and graph_memory.async_allocator(), "ComfyUI's default allocator, the CUDA runtime found"
    _calls(acc, info, lambda v: v.decode(_latent(1024)), 2)   # warm-up, capture
    if _graphs_kept():
        assert graphs.entries and graph_memory.reserved_bytes() > base, "the graph's memory is the driver's"
    mm.unload_all_models()
    assert not graphs.entries and graphs.pool is None
    assert graph_memory.reserved_bytes() <= base, "trimmed back to the device when ComfyUI unloaded the VAE"
