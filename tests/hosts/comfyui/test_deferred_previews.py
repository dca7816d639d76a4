"""hosts/comfyui/previews.py around ComfyUI's own common_ksampler, in-process (CPU), with ComfyUI's latent2rgb
previewer and a progress hook set the way ComfyUI's server sets its own: every step's progress value/max and
preview image arrive, in order, each the image stock ComfyUI shows for that step, one step later (while the next
step runs); the last at the context's end; nothing after a failure or an interrupt; ComfyUI's functions restored.

On CPU the pinned copy would defer nothing (engine/deferred_preview.to_host), so these tests give the context the
plain copy of SDACCEL_DEFERRED_PREVIEWS=always; tests/gpu/test_deferred_preview_gpu.py covers the CUDA copy."""
import importlib
import re
import threading

import numpy as np
import pytest
import torch

import comfy_inproc
from sd_accel.engine import deferred_preview as dp

STEPS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return comfy_inproc.tiny_model_patcher(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture
def previews_on():
    """--preview-method latent2rgb, and a progress hook recording what ComfyUI's server would send."""
    import comfy.cli_args
    import comfy.utils
    seen = []
    old_method, old_hook = comfy.cli_args.args.preview_method, comfy.utils.PROGRESS_BAR_HOOK
    comfy.cli_args.args.preview_method = comfy.cli_args.LatentPreviewMethod.Latent2RGB
    comfy.utils.set_progress_bar_global_hook(lambda value, total, preview, **kw: seen.append((value, total, preview)))
    yield seen
    comfy.cli_args.args.preview_method = old_method
    comfy.utils.set_progress_bar_global_hook(old_hook)


def _previews():
    from sd_accel.hosts.comfyui import previews
    return previews.DeferredPreviews(snapshot=previews.first_image_copy)


def _counting(model, fail_at=None):
    """A clone whose UNet calls are counted (and fail at call `fail_at`), through ComfyUI's unet wrapper."""
    calls = []

    def wrapper(apply_model, args):
        calls.append(len(calls))
        if fail_at is not None and len(calls) == fail_at:
            raise RuntimeError("sampler failed at call %d" % fail_at)
        return apply_model(args["input"], args["timestep"], **args["c"])
    m = model.clone()
    m.set_model_unet_function_wrapper(wrapper)
    return m, calls


def _sample(model, seed=3):
    g = torch.Generator().manual_seed(11)
    cond = [[torch.randn(1, 77, 768, generator=g), {}]]
    neg = [[torch.randn(1, 77, 768, generator=g), {}]]
    with torch.inference_mode():
        return importlib.import_module("nodes").common_ksampler(model, seed, STEPS, 5.0, "euler", "normal", cond,
                                                                neg, {"samples": torch.zeros(1, 4, 8, 8)})


def _hooked(model, seen, context):
    counted, calls = _counting(model)
    at_delivery = []
    import comfy.utils
    inner = comfy.utils.PROGRESS_BAR_HOOK
    comfy.utils.set_progress_bar_global_hook(lambda *a, **k: (at_delivery.append(len(calls)), inner(*a, **k)))
    try:
        with context:
            _sample(counted)
    finally:
        comfy.utils.set_progress_bar_global_hook(inner)
    return [(v, t, np.asarray(p[1]).copy()) for v, t, p in seen], at_delivery


def test_every_step_arrives_in_order_with_stock_s_image_one_step_later(model, previews_on):
    import contextlib
    stock, stock_at = _hooked(model, previews_on, contextlib.nullcontext())
    previews_on.clear()
    watch = _previews()
    ours, ours_at = _hooked(model, previews_on, watch)
    assert len(watch.deferred) == 1
    note = re.fullmatch(r"live previews: (\d+) delivered a few steps late, without a GPU wait per step \(([\d.]+) ms "
                        r"each on the sampler's thread to draw and hand to ComfyUI, ([\d.]+) ms waiting for the copy\)",
                        watch.note())
    assert note and int(note.group(1)) == STEPS and float(note.group(2)) > 0, watch.note()
    assert [(v, t) for v, t, _ in ours] == [(v, t) for v, t, _ in stock] == [(i + 1, STEPS) for i in range(STEPS)]
    for step, (a, b) in enumerate(zip(stock, ours)):
        assert np.array_equal(a[2], b[2]), "step %d shows another image than stock" % step
    assert not np.array_equal(stock[0][2], stock[-1][2]), "the previews move from step to step"
    # stock delivers step i after the UNet call of step i; ours after step i+1's, the last at the end
    assert ours_at == stock_at[1:] + stock_at[-1:]
    assert stock_at[1:] != stock_at[:-1]


def test_a_failing_sampler_drops_the_held_step(model, previews_on):
    counted, calls = _counting(model, fail_at=3)
    with pytest.raises(RuntimeError, match="sampler failed at call 3"):
        with _previews():
            _sample(counted)
    # steps 0 and 1 ran; step 0 was delivered at step 1's callback, step 1 was held and is dropped
    assert [(v, t) for v, t, _ in previews_on] == [(1, STEPS)]


def test_an_interrupt_from_the_hook_ends_the_run_and_nothing_follows(model, previews_on):
    import comfy.model_management as mm
    import comfy.utils
    record = comfy.utils.PROGRESS_BAR_HOOK

    def hook(value, total, preview, **kw):   # what ComfyUI's server hook does first, then a user's cancel
        mm.throw_exception_if_processing_interrupted()
        record(value, total, preview)
        mm.interrupt_current_processing(True)
    comfy.utils.set_progress_bar_global_hook(hook)
    try:
        with pytest.raises(mm.InterruptProcessingException):
            with _previews():
                _sample(model)
    finally:
        mm.interrupt_current_processing(False)
    assert [(v, t) for v, t, _ in previews_on] == [(1, STEPS)]


def test_no_previews_and_other_threads_keep_comfyuis_callback_and_the_functions_come_back(model, previews_on):
    import comfy.cli_args
    import latent_preview
    originals = (latent_preview.prepare_callback, latent_preview.get_previewer)
    comfy.cli_args.args.preview_method = comfy.cli_args.LatentPreviewMethod.NoPreviews
    watch = _previews()
    with watch:
        _sample(model)
        other = []
        t = threading.Thread(target=lambda: other.append(latent_preview.prepare_callback(model, STEPS)))
        t.start()
        t.join()
    assert watch.deferred == [] and watch.previewers == [None] and watch.note() is None
    assert [(v, t, p) for v, t, p in previews_on] == [(i + 1, STEPS, None) for i in range(STEPS)]
    assert not isinstance(other[0], dp.DeferredCallback)
    assert (latent_preview.prepare_callback, latent_preview.get_previewer) == originals
    assert "prepare_callback" in vars(latent_preview) and latent_preview.prepare_callback.__module__ == "latent_preview"


def test_only_accelerated_runs_defer_and_the_switch_turns_it_off(model, monkeypatch):
    from sd_accel.hosts.comfyui import accelerate as host
    from sd_accel.hosts.comfyui import previews, run as host_run
    accelerated = host_run.AcceleratedRun(model, [], [], host.AccelOptions(), patched=model.clone())
    plain = host_run.AcceleratedRun(model, [], [], host.AccelOptions(), patched=model)
    assert isinstance(accelerated._previews(), previews.DeferredPreviews)
    assert not isinstance(plain._previews(), previews.DeferredPreviews), "every option off: exactly KSampler"
    assert accelerated._previews().snapshot is previews.first_image_to_host
    monkeypatch.setenv("SDACCEL_DEFERRED_PREVIEWS", "0")
    assert not isinstance(accelerated._previews(), previews.DeferredPreviews)
    monkeypatch.setenv("SDACCEL_DEFERRED_PREVIEWS", "always")
    assert accelerated._previews().snapshot is previews.first_image_copy
    assert not isinstance(plain._previews(), previews.DeferredPreviews)


def test_taesd_previews_keep_comfyuis_callback(model, previews_on, tmp_path):
    """TAESD draws on the GPU from the GPU latent: a host copy would move its decode to the CPU, so it is not
    deferred (a random-weight decoder, dev/fixtures.py, found where ComfyUI looks: vae_approx)."""
    import comfy.cli_args
    import folder_paths
    import latent_preview
    fixtures = comfy_inproc.fixtures_module()
    fixtures.build_taesd(comfy_inproc.COMFY, str(tmp_path / "taesd_decoder.safetensors"))
    folder_paths.add_model_folder_path("vae_approx", str(tmp_path))
    comfy.cli_args.args.preview_method = comfy.cli_args.LatentPreviewMethod.TAESD
    watch = _previews()
    with watch:
        _sample(model)
    assert [type(p) for p in watch.previewers] == [latent_preview.TAESDPreviewerImpl]
    assert watch.deferred == []
    assert [(v, t) for v, t, _ in previews_on] == [(i + 1, STEPS) for i in range(STEPS)]
    assert all(p is not None for _, _, p in previews_on)
