"""GPU only: StepGraphs never lets a capture break the process (engine/graphs/probe.py, capture.py).

Each case runs in a subprocess under cudaMallocAsync (ComfyUI's default allocator; it is fixed at CUDA
start-up, and the worst failures show only at exit): the step's results equal the eager ones, the process
exits cleanly, and afterwards another key still captures and replays, the CUDA generator still draws, and a
plain torch graph (a stock user's) still captures."""
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRELUDE = textwrap.dedent("""
    import sys, types, torch
    pkg = types.ModuleType("sd_accel"); pkg.__path__ = [sys.argv[1]]; sys.modules["sd_accel"] = pkg
    from sd_accel.engine.graphs.step_graphs import StepGraphs
    torch.set_grad_enabled(False)   # as hosts sample; under autograd StepGraphs runs the stock step by design
    assert torch.cuda.get_allocator_backend() == "cudaMallocAsync", torch.cuda.get_allocator_backend()
    torch.manual_seed(0)
    net = torch.nn.Linear(256, 256).cuda()
    flag = {"on": False}
    graphs = StepGraphs(net, name="test")

    def until_capturable(step, x):   # calls until the probe finds the key capturable (first calls may wait once)
        outs = []
        for _ in range(4):
            outs.append(graphs.run(step, (x,), {}))
            verdict = graphs.verdicts[list(graphs.verdicts)[-1]].result
            if verdict is not None and verdict.capturable:
                return outs
        raise AssertionError("never capturable: %s" % verdict.reason)

    def still_healthy():
        y = torch.randn(8, 256, device="cuda")
        plain = lambda y: torch.relu(net(y)) + 1
        outs = [graphs.run(plain, (y,), {}) for _ in range(4)]
        assert all(torch.equal(o, plain(y)) for o in outs)
        torch.randn(16, device="cuda")                       # the CUDA generator is out of capture mode
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):                            # a stock user's graph
            z = y * 2 + torch.rand_like(y)
        g.replay()
        torch.cuda.synchronize()
""")


def _run(body, expect_in_stderr=None, allocator="backend:cudaMallocAsync"):
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=allocator, SDACCEL_DIAG="1")   # DIAG: where a capture failed
    env.pop("TRITON_INTERPRET", None)
    prelude = PRELUDE if allocator else PRELUDE.replace('assert torch.cuda.get_allocator_backend() == "cudaMallocAsync"',
                                                        'assert torch.cuda.get_allocator_backend() == "native"')
    script = prelude + textwrap.dedent(body) + "\nstill_healthy()\nprint('OK', graphs.stats, dict(graphs.refused))\n"
    p = subprocess.run([sys.executable, "-c", script, REPO], env=env, capture_output=True, text=True, timeout=300)
    if p.returncode != 0 or "OK" not in p.stdout:   # pytest.fail: the whole stderr in the report, not cut
        pytest.fail("exit %d\nstdout:\n%s\nstderr:\n%s" % (p.returncode, p.stdout[-3000:], p.stderr[-6000:]))
    if expect_in_stderr:
        assert expect_in_stderr in p.stderr + p.stdout, (p.stdout[-2000:], p.stderr[-3000:])
    return p.stdout


def test_a_host_read_of_a_computed_value_is_refused_by_the_probe_without_a_capture():
    out = _run("""
        def step(x):                       # EasyCache-style decision on a value computed in the step
            h = net(x)
            return h * 2 if (h.abs().mean() > 0.01).item() else h
        x = torch.randn(4, 256, device="cuda")
        outs = [graphs.run(step, (x,), {}) for _ in range(5)]
        assert all(torch.equal(o, step(x)) for o in outs)
        assert graphs.stats["captures"] == 0 and graphs.stats["replays"] == 0, graphs.stats
        assert any("reads a GPU value on the host" in r for r in graphs.refused), graphs.refused
    """)
    assert "captures': 1" in out      # still_healthy's key


def test_keys_an_earlier_run_left_unreplayed_never_get_the_next_runs_keys_refused_as_changing_every_call():
    """Runs whose every call was refused (a cache pack's host read) at many shapes leave their keys unreplayed; the
    next run's new keys still capture and replay: "the key changes on every call" is about one run's calls."""
    _run("""
        def cache_like(x):
            h = net(x)
            return h * 2 if (h.abs().mean() > 0.01).item() else h
        for rows in range(1, 9):           # eight runs at eight shapes, every call refused
            graphs.run(cache_like, (torch.randn(rows, 256, device="cuda"),), {}, epoch=object())
        plain = lambda y: torch.relu(net(y)) + 1
        y, epoch = torch.randn(16, 256, device="cuda"), object()
        outs = [graphs.run(plain, (y,), {}, epoch=epoch) for _ in range(4)]
        assert all(torch.equal(o, plain(y)) for o in outs)
        assert graphs.stats["replays"] >= 2 and not any("every call" in r for r in graphs.refused), (
            graphs.stats, dict(graphs.refused))
    """)


def test_an_explicit_wait_the_probe_did_not_see_fails_its_capture_cleanly():
    """torch.cuda.synchronize() and a stream's query() invalidate a capture in CUDA; the capture guards raise at
    the call instead, so the capture ends cleanly and nothing else breaks."""
    for wait in ("torch.cuda.synchronize()", "torch.cuda.current_stream().query()"):
        _run("""
            def step(x):
                h = torch.relu(net(x)) * 2.0
                if flag["on"]:
                    %s       # only once the probes saw clean steps
                return h
            x = torch.randn(4, 256, device="cuda")
            ref = torch.relu(net(x)) * 2.0
            probed = until_capturable(step, x)
            flag["on"] = True
            outs = probed + [graphs.run(step, (x,), {}) for _ in range(3)]
            flag["on"] = False
            assert all(torch.equal(o, ref) for o in outs)
            assert graphs.stats["captures"] == 0 and graphs.stats["invalidations"] == 0, graphs.stats
            assert any(r.startswith("capture failed (CaptureForbidden") for r in graphs.refused), graphs.refused
        """ % wait, expect_in_stderr="CUDA graph capture failed for test")


def test_an_invalidated_capture_is_repaired_under_the_native_allocator():
    """A wait issued from C code (out of reach of the guards) invalidates the capture in CUDA. Under torch's
    native allocator (ComfyUI --disable-cuda-malloc) the allocator's capture pool and the CUDA generator are
    taken out of capture mode, and the process goes on: other keys capture, random draws work."""
    _run("""
        import ctypes, glob, os
        libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "**", "libcudart.so*"),
                         recursive=True)
        cudart = ctypes.CDLL(libs[0])
        def step(x):
            h = torch.relu(net(x)) * 2.0
            if flag["on"]:
                cudart.cudaStreamQuery(ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
            return h
        x = torch.randn(4, 256, device="cuda")
        ref = torch.relu(net(x)) * 2.0
        probed = until_capturable(step, x)
        flag["on"] = True
        outs = probed + [graphs.run(step, (x,), {}) for _ in range(3)]
        flag["on"] = False
        assert all(torch.equal(o, ref) for o in outs)
        assert graphs.stats["invalidations"] >= 1 and graphs.stats["captures"] == 0, graphs.stats
    """, expect_in_stderr="CUDA graph capture failed for test", allocator="")


def test_a_step_that_reads_its_timestep_on_the_host_gets_a_graph_per_value():
    """Kohya Deep Shrink reads transformer_options["sigmas"][0].item() and downscales in the early steps."""
    _run("""
        def step(x, sigmas):
            h = net(x)
            if sigmas[0].item() > 5.0:
                h = torch.nn.functional.avg_pool1d(h[:, None], 2)[:, 0].repeat_interleave(2, dim=1)
            return h
        x = torch.randn(4, 256, device="cuda")
        for sigma in (9.0, 7.0, 3.0, 1.0, 9.0, 7.0, 3.0, 1.0, 9.0):
            s = torch.full((2,), sigma, device="cuda")
            assert torch.equal(graphs.run(step, (x, s), {}), step(x, s)), sigma
        assert graphs.stats["captures"] == 4 and graphs.stats["replays"] >= 4, graphs.stats
        assert not graphs.refused, graphs.refused
    """)


def test_random_draws_on_the_gpu_replay_like_eager_and_host_draws_that_matter_are_refused():
    _run("""
        def gpu_noise(x):
            return net(x) + torch.randn_like(x)
        x = torch.randn(4, 256, device="cuda")
        torch.cuda.manual_seed(7)
        ours = [graphs.run(gpu_noise, (x,), {}) for _ in range(5)]
        torch.cuda.manual_seed(7)
        ref = [gpu_noise(x) for _ in range(5)]
        assert graphs.stats["replays"] >= 3
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ours, ref))

        def host_noise(x):
            return net(x) * float(torch.rand(1))
        y = torch.randn(2, 256, device="cuda")
        for _ in range(4):
            graphs.run(host_noise, (y,), {})
        assert any("random" in r for r in graphs.refused), graphs.refused
    """)


def test_a_refused_keys_calls_skip_the_weights_check_and_a_change_made_meanwhile_is_still_seen():
    """A refused key has no graph, so its calls do not read the weights' fingerprint (a host-bound eager step
    pays each read); a weight replaced while only the refused key ran is still seen by the next replay."""
    _run("""
        table = torch.arange(256.0)                      # pageable: a capture cannot copy from it
        refused_step = lambda x: net(x) + table.to(x.device)
        plain = lambda x: torch.relu(net(x)) * 3
        x, y = torch.randn(4, 256, device="cuda"), torch.randn(2, 256, device="cuda")
        with torch.no_grad():
            for _ in range(3):
                graphs.run(plain, (y,), {})
            for _ in range(3):
                graphs.run(refused_step, (x,), {})
            assert graphs.stats["replays"] >= 1 and graphs.refused, (graphs.stats, dict(graphs.refused))
            reads = [0]
            read = graphs.fp.read
            def counted(epoch=None):
                reads[0] += 1
                return read(epoch)
            graphs.fp.read = counted
            for _ in range(3):
                assert torch.equal(graphs.run(refused_step, (x,), {}), refused_step(x))
            assert reads[0] == 0, reads
            net.weight = torch.nn.Parameter(net.weight * 0.5)   # a LoRA-style replacement, between refused calls
            assert torch.equal(graphs.run(refused_step, (x,), {}), refused_step(x))
            invalidations = graphs.stats["invalidations"]
            out = graphs.run(plain, (y,), {})
            assert graphs.stats["invalidations"] == invalidations + 1, graphs.stats
            assert torch.equal(out, plain(y))
            graphs.fp.read = read
    """)


def test_a_patchs_tensors_moved_between_runs_are_captured_again_each_time_and_never_refused():
    """A patch's own layer (outside the model) read by address: moved off the GPU and back in place between
    runs (ComfyUI's model_patches_to on a HypernetworkLoader patch), more often than the churn limit, with runs
    that replay in between. Each move captures again (`recaptures`), the output is always the eager one, and the
    key is never refused: the limit is for tensors replaced before every call."""
    _run("""
        layer = torch.nn.Linear(256, 256).cuda()
        class Patch:                       # a callable object holding its layer, as the hypernetwork's patch
            def __init__(self, layer):
                self.layers = {256: layer}
            def __call__(self, h):
                return h + self.layers[256](h)
        patch = Patch(layer)
        def step(x, transformer_options):
            return transformer_options["patches"]["attn1_patch"][0](torch.relu(net(x)))
        x = torch.randn(4, 256, device="cuda")
        opts = {"patches": {"attn1_patch": [patch]}}
        for move in range(10):
            for _ in range(3):
                out = graphs.run(step, (x,), {"transformer_options": opts})
                assert torch.equal(out, step(x, opts)), move
            held = [p.data for p in layer.parameters()]   # the old blocks stay taken, so the move lands elsewhere
            layer.cpu()
            layer.cuda()
            with torch.no_grad():
                for t in held:
                    t.fill_(float("nan"))
        assert not graphs.refused, dict(graphs.refused)
        assert graphs.stats["recaptures"] >= 9 and graphs.stats["replays"] >= 10, graphs.stats
    """)
