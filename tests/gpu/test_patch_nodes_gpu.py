"""GPU only: ComfyUI's own model patch nodes under the Accelerated KSampler, in-process on the current ComfyUI
(the `comfy_env` of test_graphs_gpu.py: the small random SD1.5 checkpoint, 256 px, euler, 6 steps).

Per patch node (dev/patch_nodes.py's table): the Accelerated KSampler's latent equals stock KSampler's with the
same patch (relative error < 2e-2: fp16 noise; every patch moves stock's image by more than 3e-2, so a lost
patch fails; a compute-dtype patch, whose effect is its rounding, is held to it otherwise: DTYPE_CASES), on the first prompt (warm-up and capture) and on the second, where the CUDA graphs replay: the
issue promises graphs for every node here, and a run that replays nothing must say in `graphs.refused` which
patch it refused. Then: plain -> patched -> plain on the same loaded model never replays a stale graph; a
capture that fails is followed, in the same process, by a working stock KSampler, CUDA RNG and allocator and
by another key's capture (a subprocess: an abort there must not take this session down, and its exit is
checked); EasyCache with the Accelerated KSampler in a real ComfyUI server on the GPU leaves it up.
"""
import json
import logging
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from test_graphs_gpu import COMFY, REPO, WORK, _rel, _sample, comfy_env  # noqa: F401  (the shared module fixture)

sys.path.insert(0, os.path.join(REPO, "dev"))
import patch_nodes  # noqa: E402

SIZE, STEPS, TOL = 256, 6, 2e-2
CASES = patch_nodes.cases(SIZE)
# fp16 noise between ours and stock is a few 1e-3 after 6 steps; a patch that moves stock's image by more than
# this is caught when lost (ours would then be that far from stock with the patch)
MIN_EFFECT = TOL + 1e-2
# a case whose effect is the compute dtype itself moves the image by that dtype's rounding, about as far as ours and
# stock then differ from each other: no tolerance tells a lost patch from noise there. A lost one is told by ours
# staying at the fp16 image instead (within fp16 noise of the plain reference). {case: its dtype's tolerance}
DTYPE_CASES = {"ModelComputeDtype_bf16": 8e-2}
FP16_NOISE = 1e-2
CACHES = ("EasyCache", "LazyCache")
STALE_CASES = ("ModelSamplingDiscrete_v_prediction", "FreeU_V2", "PatchModelAddDownscale", "ModelComputeDtype_bf16")
CAPTURE_FAILURE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "capture_failure_run.py")


@pytest.fixture(scope="module")
def plain_ref(comfy_env):  # noqa: F811
    ref, _ = _sample(comfy_env, comfy_env.model, ours=False)
    return ref


def _holders(obj, paths=3):
    """What keeps `obj` alive, for an assertion's message: up to `paths` chains of referrers from `obj` up to a root
    (a module's globals, a class, an object no tracked object refers to), breadth first over one map of every
    tracked object's referents (the frames of the calls now running left out)."""
    import gc
    running, f = set(), sys._getframe()
    while f is not None:
        running.add(id(f))
        f = f.f_back
    everything = gc.get_objects()
    referrers = {}
    for o in everything:
        if id(o) not in running:
            for r in gc.get_referents(o):
                referrers.setdefault(id(r), []).append(o)
    modules = {id(vars(m)) for m in list(sys.modules.values()) if m is not None}
    parent, queue, found = {id(obj): None}, [obj], []
    while queue and len(found) < paths:
        held = queue.pop(0)
        up = [r for r in referrers.get(id(held), ()) if id(r) not in parent and r is not everything]
        if not up or id(held) in modules or isinstance(held, type):
            found.append(held)
            continue
        for r in up:
            parent[id(r)] = held
            queue.append(r)
    out = []
    for root in found:
        chain, o = [], root
        while o is not None:
            chain.append("%s %s" % (type(o).__qualname__, repr(o)[:120].replace("\n", " ")))
            o = parent[id(o)]
        out.append("\n  <- ".join(reversed(chain)))
    return "\n".join(out) or "no holder found"


def _patched(env, case):
    if case == patch_nodes.FP8_UNET:
        import folder_paths
        folder_paths.add_model_folder_path("diffusion_models", os.path.join(WORK, "checkpoints"), is_default=True)
        return patch_nodes.load_fp8_unet("gpu_small.safetensors")
    if case == "HypernetworkLoader":
        patch_nodes.provide_hypernetwork(os.path.join(WORK, "hypernetworks"))
    return patch_nodes.apply_case(env.model, CASES[case])


def _case_names(case):
    """What a refusal of this case's patch can name: its node ids (the fp8 case: its loader and dtype)."""
    if case == patch_nodes.FP8_UNET:
        return ["UNETLoader", "fp8", "float8"]
    return [node for node, _ in CASES[case]]


class _Log(logging.Handler):
    """The messages logged at INFO or above meanwhile (EasyCache and LazyCache log how many steps they
    skipped); the root logger is at INFO for the scope (in-process, nothing set it up as main.py does)."""

    def __enter__(self):
        self.lines = []
        root = logging.getLogger()
        self.level_before = root.level
        root.setLevel(logging.INFO)
        root.addHandler(self)
        return self

    def __exit__(self, *exc):
        root = logging.getLogger()
        root.removeHandler(self)
        root.setLevel(self.level_before)

    def emit(self, record):
        self.lines.append(record.getMessage())


def _skipped(lines, case):
    found = [line for line in lines if line.startswith("%s - skipped " % case)]
    assert len(found) == 1, (case, lines[-20:])
    return int(found[0].split("skipped ")[1].split("/")[0])


def _assert_accelerated(report, what):
    failed = [n for n in report["notes"] if "accelerated run failed" in n]
    assert not failed, (what, failed)


def _assert_graphs_replayed(report, names, what):
    """Most calls of the prompt ran through a graph (fewer eager calls than replays: a warm-up per new key is
    allowed, a refused phase such as Deep Shrink's full-size steps is not); where none replayed, the report's
    refusal names the patch."""
    graphs = report["graphs"]
    refused = graphs.get("refused") or {}
    if graphs.get("replays", 0) == 0:
        assert refused and patch_nodes.names_any(list(refused), names), (what, "nothing replayed and no refusal "
                                                                          "names the patch", graphs, names)
        pytest.fail("graphs are promised for %s, but were refused: %s" % (what, refused))
    assert graphs.get("eager", 0) < graphs["replays"], (what, "more calls ran eagerly than replayed", graphs)


def _assert_moves(case, ref, plain_ref):
    effect = _rel(ref, plain_ref)
    assert effect > (FP16_NOISE if case in DTYPE_CASES else MIN_EFFECT), (
        case, "the patch moves the image too little to test", effect)


def _assert_patched_like_stock(case, prompt, out, rep, ref, plain_ref):
    assert _rel(out, ref) < DTYPE_CASES.get(case, TOL), (case, prompt, _rel(out, ref), rep["graphs"])
    if case in DTYPE_CASES:
        assert _rel(out, plain_ref) > FP16_NOISE, (case, prompt, "ours computed as without the patch",
                                                   _rel(out, plain_ref))


@pytest.mark.parametrize("case", list(CASES))
def test_patch_node_equals_stock_and_replays_graphs(comfy_env, plain_ref, case):  # noqa: F811
    model = _patched(comfy_env, case)
    with _Log() as stock_log:
        ref, _ = _sample(comfy_env, model, ours=False)
    _assert_moves(case, ref, plain_ref)
    with _Log() as first_log:
        first, rep1 = _sample(comfy_env, model)
    with _Log() as second_log:
        second, rep2 = _sample(comfy_env, model)
    for prompt, out, rep in ((1, first, rep1), (2, second, rep2)):
        _assert_patched_like_stock(case, prompt, out, rep, ref, plain_ref)
        _assert_accelerated(rep, case)
    names = patch_nodes.patch_names(comfy_env.model, model, _case_names(case))
    _assert_graphs_replayed(rep2, names, case)
    if case in CACHES:   # the cache skipped steps in every run, ours as many as stock's
        skipped = _skipped(stock_log.lines, case)
        assert skipped >= 1, stock_log.lines[-20:]
        assert _skipped(first_log.lines, case) == skipped and _skipped(second_log.lines, case) == skipped


@pytest.mark.parametrize("case", ["FreeU", "FreeU_V2"])
def test_freeus_filter_runs_sd_accels_kernel_in_the_replayed_graphs(comfy_env, case):  # noqa: F811
    """Stock's image is the test above's; here, that the filter inside the graphs is SD Accel's
    (engine/patches/freeu_filter.py), replayed on every step of the second prompt, and never fell back."""
    model = _patched(comfy_env, case)
    _sample(comfy_env, model)
    _, rep = _sample(comfy_env, model)
    assert rep["graphs"].get("replays", 0) >= STEPS and not rep["graphs"].get("captures"), rep["graphs"]
    ran = [r for r in rep["ran"] if r.startswith("freeu_filter x")]
    assert ran and int(ran[0].split(" x")[1]) >= STEPS, rep["ran"]
    assert "freeu_filter" not in rep["fell_back"], rep["fell_back"]


def test_a_patch_its_extension_switches_between_steps_never_replays_stale(comfy_env, plain_ref):  # noqa: F811
    """Forge's built-in FreeU (tests/hosts/a1111/forge_freeu_standin.py): its patch reads a class flag that the
    extension's callback sets before each step from the user's schedule: here FreeU on at the first step only, then
    (the other way) off at the first step only. The flag is in neither the call's arguments nor the patch's
    closure: a graph captured while it was on must not replay once it is off, nor the other way. The flag is set
    after each step for the next, as Forge's callback sets it before that step. Schedules switching at the first
    step: on this 6-step random model FreeU's later steps move the image too little (FreeU on for the first
    half only is 1.1e-2 from FreeU throughout) for a stale replay to stand out of fp16 noise. The extension's own
    copy of the filter runs SD Accel's kernel (engine/patches/freeu_filter.py)."""
    sys.path.insert(0, os.path.join(REPO, "tests", "hosts", "a1111"))
    from forge_freeu_standin import FreeUScript, patch_freeu_v2
    model = patch_freeu_v2(comfy_env.model, 1.5, 1.6, 0.9, 0.2)
    done = [0]

    def next_steps_flag(args):
        done[0] += 1
        FreeUScript.denoiser_callback(done[0], STEPS)
        return args["denoised"]
    model.set_model_sampler_post_cfg_function(next_steps_flag)

    def run(ours):
        done[0] = 0
        FreeUScript.denoiser_callback(0, STEPS)
        return _sample(comfy_env, model, ours=ours)
    try:
        always, _ = run(False)
        for FreeUScript.start, FreeUScript.end in ((0.0, 0.1), (0.1, 1.0)):
            ref, _ = run(False)
            assert _rel(ref, always) > MIN_EFFECT and _rel(ref, plain_ref) > MIN_EFFECT, (
                FreeUScript.end, _rel(ref, always), _rel(ref, plain_ref))
            for prompt in range(2):
                out, rep = run(True)
                assert _rel(out, ref) < TOL, (FreeUScript.end, prompt, _rel(out, ref), _rel(out, always),
                                              rep["graphs"])
            assert rep["graphs"].get("replays", 0) >= STEPS - 1, rep["graphs"]   # both phases' graphs replay
            assert any(r.startswith("freeu_filter x") for r in rep["ran"]), rep["ran"]   # its own filter: the kernel
    finally:
        FreeUScript.doFreeU, FreeUScript.start, FreeUScript.end = True, 0.0, 1.0


def test_what_a_patch_stores_in_its_module_is_stored_on_every_replay(comfy_env, plain_ref):  # noqa: F811
    """Forge's Kohya HRFix (tests/hosts/a1111/forge_kohya_hrfix_standin.py): its patches store the shape they leave
    the features in on `modules.shared` at every block call, and Forge's SAG reads it after the step. Here the
    features are shrunk for the first half of the steps: after each step the stored shape must be stock's, on the
    prompts that capture (one graph per step's sigma, which the patch reads; the first prompt's first step is its
    key's probe, so the second prompt captures that one) and on the third, all replays (a replay that stored
    nothing would leave the last step's full shape there, on which SAG folds its map at the wrong size or fails)."""
    sys.path.insert(0, os.path.join(REPO, "tests", "hosts", "a1111"))
    from forge_kohya_hrfix_standin import patch_add_downscale, shrink_shape_seen_after_each_step
    seen = []
    model = shrink_shape_seen_after_each_step(patch_add_downscale(comfy_env.model, 1, 2.0, 0.0, 0.5), seen)
    ref, _ = _sample(comfy_env, model, ours=False)
    stock_seen = list(seen)
    assert len(set(stock_seen)) == 2 and _rel(ref, plain_ref) > MIN_EFFECT, (stock_seen, _rel(ref, plain_ref))
    for prompt in range(3):
        seen.clear()
        out, rep = _sample(comfy_env, model)
        assert seen == stock_seen and _rel(out, ref) < TOL, (prompt, seen, stock_seen, _rel(out, ref), rep["graphs"])
    assert rep["graphs"].get("replays", 0) >= STEPS and not rep["graphs"].get("captures"), rep["graphs"]


@pytest.mark.parametrize("case", STALE_CASES)
def test_plain_patched_plain_never_replays_a_stale_graph(comfy_env, plain_ref, case):  # noqa: F811
    """The plain model's graphs exist (captured and replayed) when the same model gets the patch, and the
    patched model's graphs exist when it runs plain again: each must be recomputed, never replayed."""
    before, _ = _sample(comfy_env, comfy_env.model)
    before, rep_before = _sample(comfy_env, comfy_env.model)
    assert rep_before["graphs"]["replays"] >= 1, rep_before["graphs"]
    model = _patched(comfy_env, case)
    ref, _ = _sample(comfy_env, model, ours=False)
    _assert_moves(case, ref, plain_ref)
    for prompt in range(2):
        out, rep = _sample(comfy_env, model)
        _assert_patched_like_stock(case, prompt, out, rep, ref, plain_ref)
    after, rep_after = _sample(comfy_env, comfy_env.model)
    assert _rel(before, plain_ref) < TOL and _rel(after, plain_ref) < TOL, (
        case, _rel(before, plain_ref), _rel(after, plain_ref), rep_after["graphs"])


def test_the_graphs_of_a_dropped_patch_make_room_before_the_graphs_in_use(comfy_env):  # noqa: F811
    """A user tweaks FreeU_V2 on one pass of a graph whose other pass (another size) runs the plain model: each tweak
    is a new clone with new patch functions, and the old clone is freed. Its keys can never match again; when the
    tweaks' keys need room past `max_graphs`, their graphs go, and the plain pass's stays: its next prompt replays
    with no probe and no capture (a clear of the whole pool made it probe and capture again). The clones share one
    plan (hosts/comfyui/plan_reuse.py), so a switch between them is no weights change.
    A dropped patch must be dead by the next prompt's capture, where the room is made: a pack may keep the options
    of the batch call under way until the next one (Tiled Diffusion does, in a module global; its stand-in is
    loaded in this process by test_other_packs_gpu.py), so each tweak's patch is checked after the next prompt."""
    import gc
    import weakref
    other_size = 320
    _sample(comfy_env, comfy_env.model, size=other_size)
    _, rep = _sample(comfy_env, comfy_env.model, size=other_size)
    assert not rep["graphs"].get("captures") and rep["graphs"].get("replays", 0) >= STEPS, rep["graphs"]
    dropped = None
    for b1 in (1.1, 1.2, 1.3, 1.4, 1.5):
        patched = patch_nodes.apply_case(comfy_env.model, [("FreeU_V2", {"b1": b1, "b2": 1.4, "s1": 0.9, "s2": 0.2})])
        patch = weakref.ref(patched.model_options["transformer_options"]["patches"]["output_block_patch"][-1])
        _, rep = _sample(comfy_env, patched)
        assert not rep["graphs"].get("invalidations"), ("a switch of clones dropped the graphs", rep["graphs"])
        del patched
        gc.collect()
        _assert_freed(dropped)
        dropped = patch
    _, rep = _sample(comfy_env, comfy_env.model, size=other_size)
    gc.collect()
    _assert_freed(dropped)
    assert not rep["graphs"].get("captures") and rep["graphs"].get("replays", 0) >= STEPS, rep["graphs"]


def _assert_freed(ref):
    held = ref() if ref is not None else None
    assert held is None, "something still holds a dropped clone's FreeU patch:\n%s" % _holders(held)


def test_a_patchs_layers_moved_off_the_gpu_and_back_never_replay_stale(comfy_env):  # noqa: F811
    """HypernetworkLoader's layers live in its patch object, outside the UNet, so the weights fingerprint never
    reads them. ComfyUI moves a loaded clone's patch layers to the CPU when it detaches the clone for another one
    (`detach` -> `model_patches_to`), and to the GPU when it loads a clone again: the same Parameter objects at new
    addresses, the UNet's weights untouched. Graphs captured on the old addresses must be captured again, never
    replayed: the old blocks are held here and filled with NaN once the layers have moved, so a stale replay shows
    in the latent."""
    import comfy.model_management as mm
    model = _patched(comfy_env, "HypernetworkLoader")
    ref, _ = _sample(comfy_env, model, ours=False)
    _sample(comfy_env, model)
    out, rep = _sample(comfy_env, model)
    assert rep["graphs"]["replays"] >= 1 and _rel(out, ref) < TOL, (_rel(out, ref), rep["graphs"])

    def loaded_layers():   # the layers of the clone our last run loaded (it stays loaded until the next load)
        for lm in mm.current_loaded_models:
            patches = lm.model.model_options.get("transformer_options", {}).get("patches", {}).get("attn1_patch")
            if patches and lm.model.model is model.model:
                return [p for layers in patches[0].hypernet.values() for p in layers.parameters()]
        return []
    params = loaded_layers()
    assert params and all(p.is_cuda for p in params), [p.device for p in params]
    old = [p.data for p in params]            # held: the move cannot free these blocks or land in them again
    _sample(comfy_env, comfy_env.model)       # ours on the plain model: the hypernetwork's clone is detached
    assert all(p.device.type == "cpu" for p in params), "ComfyUI no longer moves a detached clone's patches"
    with torch.no_grad():                     # only now: the move to the CPU copied these blocks' values
        for t in old:
            t.fill_(float("nan"))
    out, rep = _sample(comfy_env, model)
    new = loaded_layers()
    assert new and all(p.is_cuda for p in new) and not {p.data_ptr() for p in new} & {t.data_ptr() for t in old}
    assert torch.isfinite(out).all() and _rel(out, ref) < TOL, (_rel(out, ref), rep["graphs"])
    assert rep["graphs"]["recaptures"] + rep["graphs"]["captures"] >= 1, (
        "the layers' move was not what made the graphs new", rep["graphs"])


def test_a_failed_capture_leaves_stock_rng_allocator_and_other_keys_working(comfy_env):  # noqa: F811
    """capture_failure_run.py, in its own process: a patch whose host sync fails the capture, then stock
    KSampler (plain, and ToMe drawing from the CUDA generator), a plain torch CUDA graph, and the Accelerated
    KSampler on keys never seen before (another size; another patch). The process must exit 0."""
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, CAPTURE_FAILURE_SCRIPT, COMFY, WORK], env=env, capture_output=True,
                       text=True, timeout=500)
    tail = p.stdout[-3000:] + p.stderr[-5000:]
    assert p.returncode == 0, (p.returncode, tail)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, tail
    r = json.loads(lines[0][len("RESULT "):])
    for prompt, (rel, report) in enumerate(zip(r["failing_rel"], r["failing_reports"])):
        assert rel < TOL, ("the failing patch's prompt", prompt, rel, report["graphs"])
        _assert_accelerated(report, "failing patch")
        assert report["graphs"]["replays"] == 0, ("the capture did not fail: nothing was tested", report["graphs"])
        refused = report["graphs"].get("refused") or {}
        names = r["failing_names"]
        assert refused and patch_nodes.names_any(list(refused), names), (report["graphs"], names)
    # channels_last is for graphs: once the capture failed, the run's later steps and the next run are in stock's
    # layout, where ComfyUI's modules run faster (each list: one entry per UNet call, True = channels_last)
    first, second = r["failing_layouts"]
    assert any(first) and not first[-1] and not any(second), r["failing_layouts"]
    # stock again on the same loaded model: within fp16 noise (a failed run may end before its conv weights are put
    # back in stock's layout, which changes cuDNN's rounding); a generator or allocator left in capture mode would
    # raise or give another image altogether
    assert r["stock_plain_rel"] < TOL and r["stock_tome_rel"] < TOL, r
    assert r["torch_graph_ok"] and r["cuda_rng_ok"], r
    for what in ("new_size", "other_patch"):
        rel, report = r[what]
        assert rel < TOL, (what, rel, report["graphs"])
        _assert_accelerated(report, what)
        assert report["graphs"]["captures"] >= 1 and report["graphs"]["replays"] >= 1, (what, report["graphs"])


def _image_psnr(path_a, path_b):
    import numpy as np
    from PIL import Image
    a, b = (np.asarray(Image.open(p).convert("RGB")).astype(np.float64) for p in (path_a, path_b))
    mse = float(((a - b) ** 2).mean())
    return 99.0 if mse == 0 else float(10 * np.log10(255.0 ** 2 / mse))


def _server_graph(sampler, prefix):
    g = {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "gpu_small.safetensors"}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cat", "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["4", 1]}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
        "20": {"class_type": "EasyCache", "inputs": dict(patch_nodes.CACHE, model=["4", 0])},
        "3": {"class_type": sampler, "inputs": {"seed": 5, "steps": STEPS, "cfg": 7.0, "sampler_name": "euler",
                                                "scheduler": "normal", "denoise": 1.0, "model": ["20", 0],
                                                "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["5", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": prefix, "images": ["8", 0]}},
    }
    if sampler == "SDAccelKSampler":
        g["3"]["inputs"].update(fused_kernels=True, cuda_graph=True, channels_last=True)
    return g


def test_easycache_with_accelerated_ksampler_in_a_gpu_server_stays_up(comfy_env):  # noqa: F811
    """A real ComfyUI server on the GPU (the pack in its custom_nodes): EasyCache + stock KSampler, then
    EasyCache + Accelerated KSampler twice (warm-up and capture, then replays). Every prompt succeeds, the
    server still answers /object_info after, and ours gives stock's image."""
    import comfy_server
    work = tempfile.mkdtemp(prefix="sdaccel_gpu_server_")
    srv = comfy_server.ComfyServer(COMFY, sys.executable, work, WORK, cpu=False,
                                   extra_args=comfy_server.empty_frontend(work))
    srv.start()
    try:
        stock = srv.run(_server_graph("KSampler", "ec_stock"))
        for prompt in range(2):
            ours = srv.run(_server_graph("SDAccelKSampler", "ec_ours%d" % prompt))
            report = ours["outputs"]["3"]["sdaccel_report"][0]
            _assert_accelerated(report, "EasyCache in the server")
            db = _image_psnr(srv.output_images(stock)[0], srv.output_images(ours)[0])
            assert db >= 35, (prompt, db, report)
        assert srv.proc.poll() is None, srv.log_tail()
        assert "EasyCache" in srv.object_info()
    finally:
        log = srv.log_text()
        srv.stop()
    assert "terminate called" not in log and "previous error during capture" not in log, log[-4000:]
