"""GraphedForward's policy (engine/graphs/graphed_forward.py): a call the host refuses runs the module's own forward
eagerly, counted with its reason as a refused key's calls are; the graphs (and how many shapes they keep) are the
module's, shared by every stand-in of it."""
import torch

from sd_accel.engine.graphs.graphed_forward import GraphedForward, Policy


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
    assert torch.equal(gf(x), m(x))
    assert not gf.graphs.refused and gf.graphs.last_eager_reason == "no CUDA device"


def test_stand_ins_of_one_module_share_its_graphs_and_the_first_policy_sizes_them():
    m = _module()
    a = GraphedForward(m, "lin", policy=Policy(max_graphs=8))
    b = GraphedForward(m, "lin", cuda_graph=False)
    assert a.graphs is b.graphs and a.graphs.max_graphs == 8
    assert GraphedForward(_module(), "other").graphs.max_graphs == 4
