"""FreeU's and FreeU_V2's skip filter through SD Accel's kernel on accelerated runs, in process on the CPU (the
kernel interpreted; the GPU plan forced, the UNet's own modules on the eager path so that only the filter is
SD Accel's): stock's latent to fp32 rounding, the stock filter never called on an accelerated run and called as
before on stock's, another pack's replacement of the filter kept, one copy per closure for the graph keys."""
import gc

import pytest
import torch

import comfy_inproc

FREEU = {"FreeU": (1.1, 1.2, 0.9, 0.2), "FreeU_V2": (1.3, 1.4, 0.9, 0.2)}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # the small preset: 320 and 640 channels, where FreeU filters (its scales are keyed on 2x and 4x 320)
    return comfy_inproc.tiny_model_patcher(tmp_path_factory.mktemp("ckpt"), preset="small")


@pytest.fixture
def gpu_plan_stock_modules(monkeypatch):
    from sd_accel.engine.graphs import eager
    from sd_accel.hosts.comfyui import accelerate as host
    monkeypatch.setattr(host, "_loads_on_cuda", lambda p: True)
    monkeypatch.setattr(eager, "FORCED_PATH", "stock")
    return host


@pytest.fixture
def filter_calls(monkeypatch):
    """Calls of the stock Fourier_filter, counted where FreeU's closures look it up."""
    import comfy_extras.nodes_freelunch as freelunch
    stock, calls = freelunch.Fourier_filter, []

    def counted(*a, **kw):
        calls.append(a[0].shape)
        return stock(*a, **kw)
    counted.__module__, counted.__qualname__ = stock.__module__, stock.__qualname__   # still the node's own
    monkeypatch.setattr(freelunch, "Fourier_filter", counted)
    return calls


def _freeu(model, node):
    import comfy_extras.nodes_freelunch as freelunch
    return getattr(freelunch, node)().patch(model, *FREEU[node])[0]


def _accelerated(host, patched):
    import comfy.model_management as mm
    mm.unload_all_models()
    return host.accelerate(patched, host.AccelOptions(cuda_graph=False, channels_last=False))[0]


def _sample(model):
    import comfy.model_management as mm
    out = comfy_inproc.sample_tiny(model, steps=2, cfg=2.0)
    mm.unload_all_models()
    return out


@pytest.mark.parametrize("node", sorted(FREEU))
def test_accelerated_freeu_filters_through_the_kernel_with_stocks_latent(model, node, gpu_plan_stock_modules,
                                                                        filter_calls):
    from sd_accel.engine.reports import kernel_report
    patched = _freeu(model, node)
    plain = _sample(model)
    stock = _sample(patched)
    assert filter_calls, "FreeU never filtered: the test's model has no skip FreeU acts on"
    assert float((stock - plain).norm() / plain.norm()) > 1e-3        # FreeU changes this model's latent
    stock_calls = len(filter_calls)
    before = kernel_report.snapshot()
    ours = _sample(_accelerated(gpu_plan_stock_modules, patched))
    ran = kernel_report.summarize(before, kernel_report.snapshot())
    assert len(filter_calls) == stock_calls, "the stock filter ran on the accelerated run"
    assert ran.get("freeu_filter", {}).get("fused"), ran
    assert float((ours - stock).norm() / stock.norm()) < 1e-5
    again = _sample(patched)
    assert torch.equal(again, stock) and len(filter_calls) == 2 * stock_calls   # stock's own filter, as before


@pytest.mark.parametrize("when", ["before the first run", "after an accelerated run"])
def test_another_packs_filter_is_kept(model, gpu_plan_stock_modules, monkeypatch, filter_calls, when):
    import comfy_extras.nodes_freelunch as freelunch
    stock, theirs = freelunch.Fourier_filter, []

    def their_filter(x, threshold, scale):   # e.g. a pack that moves the FFT elsewhere
        theirs.append(x.shape)
        return stock(x, threshold=threshold, scale=scale)
    patched = _freeu(model, "FreeU_V2")
    accelerated = _accelerated(gpu_plan_stock_modules, patched)
    if when == "after an accelerated run":
        _sample(accelerated)
        assert not filter_calls
    monkeypatch.setattr(freelunch, "Fourier_filter", their_filter)
    stock_latent = _sample(patched)
    n = len(theirs)
    assert n > 0
    ours = _sample(accelerated)
    assert len(theirs) == 2 * n
    assert torch.equal(ours, stock_latent)


def test_one_copy_per_closure_living_as_long_as_it(model):
    from sd_accel.engine.graphs import keys
    from sd_accel.engine.patches import freeu_filter
    first = _freeu(model, "FreeU_V2")
    patch = first.model_options["transformer_options"]["patches"]["output_block_patch"][0]
    options = first.model_options["transformer_options"]
    a, b = freeu_filter.on_fast_filter((), {"transformer_options": options}, options)[2], \
        freeu_filter.on_fast_filter((), {"transformer_options": options}, options)[2]
    assert a is not options and options["patches"]["output_block_patch"] == [patch]   # the user's options untouched
    copy = a["patches"]["output_block_patch"][0]
    assert copy is b["patches"]["output_block_patch"][0] and copy is not patch
    assert copy.__code__ is patch.__code__ and copy.__closure__ is patch.__closure__
    key = lambda to: keys.flatten(to).key  # noqa: E731
    assert key(a) == key(b)                                  # the same graph key on every call
    other = _freeu(model, "FreeU_V2").model_options["transformer_options"]
    assert key(freeu_filter.on_fast_filter((), {}, other)[2]) != key(a)     # another node's closure: another key
    assert freeu_filter.fast_copy(lambda h, hsp, to: (h, hsp)) is None   # any other output_block_patch: as it is
    gc.collect()                            # earlier tests' copies waiting in garbage cycles: gone before counting
    alive = len(freeu_filter._copies)
    del first, options, a, b, copy, patch
    gc.collect()
    assert len(freeu_filter._copies) == alive - 1


def _forge_freeu():
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "a1111"))
    import forge_freeu_standin
    return forge_freeu_standin


def test_an_extensions_own_copy_of_the_filter_runs_the_kernel_with_stocks_latent(model, gpu_plan_stock_modules):
    """Forge's built-in FreeU (its stand-in: the extension's own `Fourier_filter` in its own module, the patch
    switched by a class flag): recognised by what its filter computes, so accelerated runs get the kernel."""
    from sd_accel.engine.reports import kernel_report
    forge = _forge_freeu()
    patched = forge.patch_freeu_v2(model, 1.3, 1.4, 0.9, 0.2)
    plain, stock = _sample(model), _sample(patched)
    assert float((stock - plain).norm() / plain.norm()) > 1e-3
    before = kernel_report.snapshot()
    ours = _sample(_accelerated(gpu_plan_stock_modules, patched))
    ran = kernel_report.summarize(before, kernel_report.snapshot())
    assert ran.get("freeu_filter", {}).get("fused"), ran
    assert float((ours - stock).norm() / stock.norm()) < 1e-5


def test_a_modules_own_filter_that_computes_otherwise_is_kept():
    """A module's own `Fourier_filter` that is not FreeU's filter (here: a wider window) is never swapped; nor one
    the patch's module did not define (another pack's, in test_another_packs_filter_is_kept)."""
    import types as pytypes
    from sd_accel.engine.patches import freeu_filter
    forge = _forge_freeu()
    source = ("import torch\n"
              "def Fourier_filter(x, threshold, scale):\n"
              "    f = torch.fft.fftshift(torch.fft.fftn(x.float(), dim=(-2, -1)), dim=(-2, -1))\n"
              "    r, c = f.shape[-2] // 2, f.shape[-1] // 2\n"
              "    f[..., r - 2:r + 2, c - 2:c + 2] *= scale\n"
              "    return torch.fft.ifftn(torch.fft.ifftshift(f, dim=(-2, -1)), dim=(-2, -1)).real.to(x.dtype)\n"
              "def output_block_patch(h, hsp, transformer_options):\n"
              "    return h, Fourier_filter(hsp, threshold=1, scale=0.5)\n")
    other = pytypes.ModuleType("wider_filter_pack")
    exec(compile(source, "wider_filter_pack.py", "exec"), other.__dict__)  # noqa: S102 - a module of the test's
    assert freeu_filter.fast_copy(other.output_block_patch) is None
    theirs = forge.make_output_block_patch(320, 1.3, 1.4, 0.9, 0.2)
    copy = freeu_filter.fast_copy(theirs)
    assert copy is not None and copy.__globals__["Fourier_filter"] is not forge.Fourier_filter
    assert copy.__globals__["FreeUScript"] is forge.FreeUScript   # the extension's live flag, read by the copy
