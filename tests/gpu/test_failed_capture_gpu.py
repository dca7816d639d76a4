"""GPU only: a step that cannot be captured (here a copy from pageable host memory, which waits for the GPU and
which a capture refuses) is found by the probe on its first calls, runs eagerly with the right result, is never
captured, and the process exits cleanly under cudaMallocAsync (where freeing what a failed capture allocated
aborts the process). A subprocess, because the allocator is fixed at CUDA start-up and failures show at exit."""
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import sys, types, torch
    pkg = types.ModuleType("sd_accel"); pkg.__path__ = [sys.argv[1]]; sys.modules["sd_accel"] = pkg
    from sd_accel.engine.graphs.step_graphs import StepGraphs
    assert torch.cuda.get_allocator_backend() == "cudaMallocAsync", torch.cuda.get_allocator_backend()
    net = torch.nn.Linear(256, 256).cuda()
    table = torch.arange(256.0)                       # pageable: a capture cannot copy from it

    def step(x):
        h = torch.relu(net(x)) * 2.0                  # allocated inside the capture
        return h + table.to(x.device)                 # fails inside a capture
    graphs = StepGraphs(net, name="test")
    x = torch.randn(4, 256, device="cuda")
    with torch.no_grad():
        ref = step(x)
        outs = [graphs.run(step, (x,), {}) for _ in range(4)]   # two probes, then eager
    assert all(torch.equal(o, ref) for o in outs)
    assert graphs.stats["captures"] == 0 and graphs.stats["replays"] == 0 and graphs.stats["eager"] == 4, graphs.stats
    assert any("waits for the GPU inside the step" in r for r in graphs.refused), dict(graphs.refused)
    print("OK")
""")


def test_a_failed_capture_runs_eagerly_and_the_process_exits_cleanly():
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-c", SCRIPT, REPO], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "OK" in p.stdout, (p.returncode, p.stdout[-2000:] + p.stderr[-4000:])
