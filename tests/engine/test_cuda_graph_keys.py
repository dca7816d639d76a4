"""The parts of CUDA-graph replay that decide correctness and run on any device: what goes into the
graph key, what is copied into static buffers, and when the weights count as changed."""
import torch

from sd_accel.engine import cuda_graph as cg


def _key(obj):
    tensors, key = [], []
    cg._flatten(obj, tensors, key)
    return tensors, tuple(key)


def test_tensor_values_are_inputs_but_structure_and_shapes_are_key():
    big = lambda *shape: torch.randn(*shape)  # noqa: E731  (> SMALL_HOST_TENSOR: a graph input)
    a = {"x": big(2, 4, 8, 8), "opts": {"cond_or_uncond": [1, 0], "ctx": big(2, 77, 8)}, "n": 3}
    b = {"x": big(2, 4, 8, 8), "opts": {"cond_or_uncond": [1, 0], "ctx": big(2, 77, 8)}, "n": 3}
    ta, ka = _key(a)
    tb, kb = _key(b)
    assert ka == kb and len(ta) == 2
    assert _key({**b, "n": 4})[1] != ka                          # a non-tensor value changes the graph
    assert _key({**b, "x": big(3, 4, 8, 8)})[1] != ka            # so does a shape
    assert _key({**b, "x": big(2, 4, 8, 8).half()})[1] != ka     # a dtype
    assert _key({**b, "x": big(2, 8, 8, 4).permute(0, 3, 1, 2)})[1] != ka   # and a layout (strides)
    patch1, patch2 = (lambda q: q), (lambda q: q)
    assert _key({"p": patch1})[1] != _key({"p": patch2})[1]      # other patch objects: other graph
    assert _key({"p": patch1})[1] == _key({"p": patch1})[1]


def test_small_host_tensors_and_uuids_are_keyed_by_value():
    import uuid
    u = uuid.uuid4()
    t1, k1 = _key({"sample_sigmas": torch.tensor([14.6, 7.0, 0.0]), "uuids": [u]})
    t2, k2 = _key({"sample_sigmas": torch.tensor([14.6, 7.0, 0.0]), "uuids": [uuid.UUID(str(u))]})
    assert not t1 and k1 == k2
    assert _key({"sample_sigmas": torch.tensor([14.6, 6.0, 0.0]), "uuids": [u]})[1] != k1


def test_rebuild_puts_static_tensors_back_in_place():
    obj = ({"x": torch.ones(300), "l": [torch.zeros(400), 5, None, torch.ones(2)]}, (torch.full((300,), 2.0),))
    tensors, _ = _key(obj)
    statics = [cg._static_copy(t) for t in tensors]
    out = cg._rebuild(obj, iter(statics))
    assert out[0]["x"] is statics[0] and out[0]["l"][0] is statics[1] and out[1][0] is statics[2]
    assert out[0]["l"][1:3] == [5, None] and out[0]["l"][3] is obj[0]["l"][3]


def test_weights_fingerprint_sees_replaced_inplace_and_inference_tensors():
    lin = torch.nn.Linear(4, 4)
    fp = cg.WeightsFingerprint(lin)
    epoch = object()
    f0, _ = fp.read(epoch)
    assert fp.read(epoch)[0] == f0
    with torch.no_grad():
        lin.weight.add_(1)                      # in place: version counter moves
    f1, _ = fp.read(epoch)
    assert f1 != f0
    lin.weight = torch.nn.Parameter(lin.weight.detach().clone())   # replaced, as a LoRA patch does
    assert fp.read(epoch)[0] != f1
    with torch.inference_mode():                 # ComfyUI's weights are inference tensors
        inf = torch.nn.Linear(4, 4)
    fpi = cg.WeightsFingerprint(inf)
    a, all_cuda = fpi.read(None)
    assert not all_cuda and a == fpi.read(None)[0]


def test_within_a_run_objects_and_versions_are_checked_and_data_swaps_wait_for_the_next_run():
    """The per-step read within one run (epoch) compares tensor objects and version counters only: a replaced
    Parameter or buffer and an in-place write are seen at once; a `.data` swap of the same Parameter (which
    hosts do at load time, before a run) is seen at the next run's first read."""
    with torch.inference_mode():
        lin = torch.nn.Linear(4, 4)                # ComfyUI's weights: inference tensors, no version counter
    lin.register_buffer("table", torch.zeros(3))
    fp = cg.WeightsFingerprint(lin)
    e = object()
    f0, _ = fp.read(e)
    assert fp.read(e)[0] == f0
    lin.bias = torch.nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
    f1, _ = fp.read(e)
    assert f1 != f0                                 # replaced object: seen within the run
    lin.table.add_(1)                               # in place on a tensor with a version counter
    f2, _ = fp.read(e)
    assert f2 != f1
    lin.table = None                                # a buffer dropped
    f3, _ = fp.read(e)
    assert f3 != f2
    plain = torch.nn.Linear(4, 4)
    fpp = cg.WeightsFingerprint(plain)
    g0, _ = fpp.read(e)
    plain.weight.data = plain.weight.data.clone()  # same Parameter, new data (its version counter stays)
    assert fpp.read(e)[0] == g0, "within the run: not read again"
    assert fpp.read(object())[0] != g0, "the next run's first read sees it"
    assert fpp.read(None)[0] == fpp.read(None)[0]


def test_tree_is_reread_when_the_epoch_changes():
    seq = torch.nn.Sequential(torch.nn.Linear(2, 2))
    fp = cg.WeightsFingerprint(seq)
    e1 = object()
    f1, _ = fp.read(e1)
    seq[0] = torch.nn.Linear(2, 2)              # a module swapped, as object patches do at load time
    assert fp.read(e1)[0] == f1, "same run: the tree is not walked again"
    assert fp.read(object())[0] != f1, "a new run walks the tree again and sees the new module"


def test_no_cuda_runs_eagerly_and_says_why():
    g = cg.StepGraphs(torch.nn.Linear(2, 2))
    if torch.cuda.is_available():
        return
    out = g.run(lambda x: x * 2, (torch.ones(2),), {})
    assert torch.equal(out, torch.full((2,), 2.0))
    assert g.stats["eager"] == 1 and g.last_eager_reason == "no CUDA device"


def test_ignored_entries_pass_through_but_leave_the_key():
    import uuid
    t1, k1, t2, k2 = [], [], [], []
    cg._flatten({"uuids": [uuid.uuid4()], "x": torch.randn(300)}, t1, k1, ("uuids",))
    cg._flatten({"uuids": [uuid.uuid4()], "x": torch.randn(300)}, t2, k2, ("uuids",))
    assert k1 == k2 and len(t1) == 1
    t3, k3 = [], []
    cg._flatten({"uuids": [uuid.uuid4()], "x": torch.randn(300)}, t3, k3)
    assert k3 != k1


def test_a_replay_counts_the_kernels_its_capture_recorded():
    """The run report reads kernel_report: a replayed graph must count the fused kernels it holds,
    or a run served entirely from graphs would report that no fused kernel ran."""
    from sd_accel.engine import kernel_report

    class _Op:
        last_path, last_reason = "triton", ""
    k0 = kernel_report.snapshot()
    kernel_report.record("demo_op", _Op)          # what a capture records, once per call in the step
    kernel_report.record("demo_op", _Op)
    calls = kernel_report.calls_between(k0, kernel_report.snapshot())
    k1 = kernel_report.snapshot()
    kernel_report.replayed(calls)
    kernel_report.replayed(calls)
    assert kernel_report.summarize(k1, kernel_report.snapshot())["demo_op"] == {"fused": 4, "fallback": 0, "reasons": []}


def test_cudnn_autotune_scope_sets_and_restores_the_flag():
    import torch
    before = torch.backends.cudnn.benchmark
    seen = []
    with cg.cudnn_autotuned():
        seen.append(torch.backends.cudnn.benchmark)
    with cg.cudnn_autotuned(False):
        seen.append(torch.backends.cudnn.benchmark)
    try:
        with cg.cudnn_autotuned():
            raise KeyError("x")
    except KeyError:
        pass
    assert seen == [True, before] and torch.backends.cudnn.benchmark is before


def test_autotuning_is_on_by_default_and_held_off_inside_a_budget_scope(monkeypatch):
    monkeypatch.setattr(cg, "CUDNN_AUTOTUNE", True)
    assert cg.autotune_now()
    with cg.under_vram_budget():
        with cg.under_vram_budget():
            assert not cg.autotune_now()
        assert not cg.autotune_now()
    assert cg.autotune_now()
    monkeypatch.setattr(cg, "CUDNN_AUTOTUNE", False)   # SDACCEL_CUDNN_AUTOTUNE=0
    assert not cg.autotune_now()


def test_graphs_are_freed_once_the_weights_have_left_the_gpu():
    """What the hosts call when ComfyUI detaches a model: CPU weights here, so the graphs go."""
    g = cg.StepGraphs(torch.nn.Linear(2, 2))
    g.warm.add(("some key",))
    g.clear_if_offloaded()
    assert not g.warm and g.stats["invalidations"] == 1


def test_a_model_run_inside_another_models_step_runs_eagerly_without_graphs_of_its_own():
    """ControlNets evaluated inside the UNet's step (its warm-up or capture) must not warm up or capture
    graphs of their own: those would never replay and only hold memory."""
    inner = cg.StepGraphs(torch.nn.Linear(2, 2), name="controlnet")
    calls = []
    with cg._step_running():
        out = inner.run(lambda x: calls.append(x) or x * 2, (torch.ones(3),), {})
    assert torch.equal(out, torch.full((3,), 2.0)) and len(calls) == 1
    assert inner.last_eager_reason == "inside another model's step"
    assert inner.stats == {"captures": 0, "replays": 0, "eager": 1, "invalidations": 0}
    assert not inner.warm and not inner.entries
    inner.run(lambda x: x, (torch.ones(3),), {})
    assert inner.last_eager_reason != "inside another model's step", "only while the outer step runs"


def test_no_garbage_collection_while_capturing(monkeypatch):
    """A collection during a capture frees the garbage's CUDA tensors inside it, which aborted the process under
    cudaMallocAsync (device run 57): the collector is paused for the capture and restored after, also when the
    capture raises (CPU: the capture itself is stood in for)."""
    import contextlib
    import gc
    from sd_accel.engine import cuda_graph
    seen = []

    @contextlib.contextmanager
    def fake_capture(graph, pool):
        seen.append(gc.isenabled())
        yield
    monkeypatch.setattr(cuda_graph, "_capturing_on_side_stream", fake_capture)
    assert gc.isenabled()
    with cuda_graph._capturing(None, None):
        seen.append(gc.isenabled())
    assert seen == [False, False] and gc.isenabled()
    try:
        with cuda_graph._capturing(None, None):
            raise RuntimeError("capture failed")
    except RuntimeError:
        pass
    assert gc.isenabled()
    gc.disable()
    try:
        with cuda_graph._capturing(None, None):
            pass
        assert not gc.isenabled(), "a collector the host had paused stays paused"
    finally:
        gc.enable()
