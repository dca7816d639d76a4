"""GraphedForward's policy (engine/graphs/graphed_forward.py): a call the host refuses runs the module's own forward
eagerly, counted with its reason as a refused key's calls are; the graphs (and how many shapes they keep) are the
module's, shared by its stand-ins of one conv layout."""
import torch

from sd_accel.engine.graphs import graphed_forward
from sd_accel.engine.graphs.graphed_forward import GraphedForward, Policy
from refcount import no_garbage_collection


def _module():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def test_a_call_the_policy_refuses_runs_eagerly_and_is_counted_with_its_reason():
    m, x = _module(), torch.randn(2, 4)
    seen = []

    def refuse(args, kwargs):
        seen.append((tuple(args[0].shape), kwargs))
        return "too large to keep a graph"
    gf = GraphedForward(m, "lin", policy=Policy(refuse=refuse))
    assert torch.equal(gf(x), m(x)) and torch.equal(gf(x), m(x))
    assert seen == [((2, 4), {}), ((2, 4), {})]
    assert dict(gf.graphs.refused) == {"too large to keep a graph": 2} and gf.graphs.stats["eager"] == 2
    assert not gf.graphs.verdicts, "refused before any graph key was probed"


def test_without_a_refusal_a_cpu_call_runs_eagerly_for_want_of_cuda():
    m, x = _module(), torch.randn(2, 4)
    gf = GraphedForward(m, "lin", policy=Policy(refuse=lambda a, k: None))
    with torch.no_grad():   # as hosts call their models
        assert torch.equal(gf(x), m(x))
    assert not gf.graphs.refused and gf.graphs.last_eager_reason == "no CUDA device"


def test_under_autograd_a_call_runs_the_stock_modules_and_says_why():
    """A training step (autograd on): never timed, never captured, the stock modules; its gradient flows as stock's."""
    from sd_accel.engine.graphs import eager
    m, x = _module(), torch.randn(2, 4, requires_grad=True)
    gf = GraphedForward(m, "lin", policy=Policy(refuse=lambda a, k: None))
    out = gf(x)
    assert torch.equal(out, m(x)) and out.requires_grad
    out.sum().backward()
    assert x.grad is not None
    assert gf.graphs.refused == {eager.AUTOGRAD: 1} and gf.graphs.last_eager_reason == eager.AUTOGRAD
    assert gf.graphs.eager_paths.stock_calls == 1


def test_stand_ins_of_one_module_and_layout_share_its_graphs_and_the_first_policy_sizes_them():
    m = _module()
    a = GraphedForward(m, "lin", policy=Policy(max_graphs=8))
    b = GraphedForward(m, "lin", cuda_graph=False)
    assert a.graphs is b.graphs and a.graphs.max_graphs == 8
    assert GraphedForward(_module(), "other").graphs.max_graphs == 4
    # graphs captured over channels_last weights read them in that layout: never replayed by a stand-in that
    # runs over stock's layout (Accelerated KSampler with channels_last off)
    stock_layout = GraphedForward(m, "lin", channels_last=False)
    assert stock_layout.graphs is not a.graphs
    assert GraphedForward.for_module(m, "lin", channels_last=False).graphs is stock_layout.graphs


def _conv_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.SiLU(), torch.nn.Conv2d(8, 4, 1))


def _weights(m):
    return [c.weight for c in m if isinstance(c, torch.nn.Conv2d)]


def test_stock_layout_is_restored_in_place_and_a_later_call_converts_again_before_any_graph_runs(monkeypatch):
    m = _conv_net()
    before = [(w.data_ptr(), w.clone()) for w in _weights(m)]
    gf = GraphedForward(m, "net", channels_last=True)
    assert gf._to_channels_last() and all(w.is_contiguous(memory_format=torch.channels_last) for w in _weights(m))
    gf.to_stock_layout()
    assert all(w.is_contiguous() for w in _weights(m)) and gf.relayout_pending
    # the same storage and values (graphs captured over these addresses stay valid)
    assert [w.data_ptr() for w in _weights(m)] == [ptr for ptr, _ in before]
    assert all(torch.equal(w, v) for w, (_, v) in zip(_weights(m), before))
    # a GPU call converts first (graphs were captured over channels_last weights); the CPU has no graphs, so
    # the test stands the CPU in for the GPU. ComfyUI calls a ControlNet with keyword arguments only
    monkeypatch.setattr(graphed_forward, "GRAPH_DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    gf(input=torch.randn(1, 4, 8, 8))   # inside another model's capture: the host settled the layout before it
    assert all(w.is_contiguous() for w in _weights(m)) and gf.relayout_pending
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    gf(input=torch.randn(1, 4, 8, 8))
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in _weights(m)) and not gf.relayout_pending


def test_a_stand_in_that_never_converted_leaves_the_layout_alone():
    m = _conv_net()
    gf = GraphedForward(m, "net", channels_last=True)
    gf.to_stock_layout()
    assert not gf.relayout_pending and all(w.is_contiguous() for w in _weights(m))
    gf(torch.randn(1, 4, 8, 8))   # a CPU call after no conversion: nothing to put back
    assert all(w.is_contiguous() for w in _weights(m))


def test_a_module_wearing_its_stand_in_is_freed_without_a_garbage_collection():
    """Set as the module's own `forward` (an object patch ComfyUI leaves applied on a loaded copy it frees: Apply SD
    Accel (CLIP)'s text encoder after a lowvram VRAM Pool run, on the GPU), the stand-in must not hold its module
    in a cycle: the model the user dropped is freed, with its VRAM, by reference counting alone."""
    import weakref
    m, x = _module(), torch.randn(2, 4)
    m.forward = GraphedForward.for_module(m, "lin")
    assert torch.equal(m(x), type(m).forward(m, x))
    ref = weakref.ref(m)
    with no_garbage_collection():
        del m
        assert ref() is None, "the module outlived its last reference"
