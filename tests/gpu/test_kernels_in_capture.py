"""GPU only: the fused kernels run INSIDE a CUDA-graph capture under cudaMallocAsync (ComfyUI's default
allocator), through `_launch.launch`'s compiled-kernel path, and the replayed graph computes the same as
the references on fresh inputs. A subprocess, because the allocator backend is fixed at CUDA start-up."""
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import sys, types, torch
    pkg = types.ModuleType("sd_accel"); pkg.__path__ = [sys.argv[1]]; sys.modules["sd_accel"] = pkg
    from sd_accel.kernels import _launch
    from sd_accel.kernels.group_norm_silu import group_norm_silu, group_norm_silu_reference
    from sd_accel.kernels.geglu import geglu, geglu_reference
    from sd_accel.kernels.layer_norm import layer_norm, layer_norm_reference
    from sd_accel.kernels.bias_residual_add import bias_residual_add, bias_residual_add_reference
    assert torch.cuda.get_allocator_backend() == "cudaMallocAsync", torch.cuda.get_allocator_backend()
    dev = "cuda"
    x = torch.randn(2, 320, 32, 32, device=dev, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    x2 = torch.randn(2, 320, 64, 64, device=dev, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    w = torch.randn(320, device=dev, dtype=torch.float16); b = torch.randn(320, device=dev, dtype=torch.float16)
    h = torch.randn(2, 1024, 2560, device=dev, dtype=torch.float16)
    t = torch.randn(2, 1024, 320, device=dev, dtype=torch.float16)
    lw = torch.randn(320, device=dev, dtype=torch.float16); lb = torch.randn(320, device=dev, dtype=torch.float16)

    def step(x, h, t, x2):
        # intermediates allocated inside the capture: the case Triton's own launcher cannot address
        y = group_norm_silu(x * 1.0, 32, w, b)              # one program per group
        y2 = group_norm_silu(x2 * 1.0, 32, w, b)            # split: statistics + apply
        r = bias_residual_add(x2 * 1.0, x2, b)
        return y, geglu(h + 0.0), layer_norm(t + 0.0, (320,), lw, lb), y2, r

    ops = (group_norm_silu, geglu, layer_norm, bias_residual_add)
    step(x, h, t, x2)                               # eager: compiles
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step(x, h, t, x2)
    paths = [f.last_call.path for f in ops]
    assert paths == ["triton"] * 4, (paths, [f.last_call.reason for f in ops])
    for _ in range(2):
        x.copy_(torch.randn_like(x)); h.copy_(torch.randn_like(h)); t.copy_(torch.randn_like(t))
        x2.copy_(torch.randn_like(x2))
        g.replay(); torch.cuda.synchronize()
        refs = (group_norm_silu_reference(x, 32, w, b), geglu_reference(h), layer_norm_reference(t, (320,), lw, lb),
                group_norm_silu_reference(x2, 32, w, b), bias_residual_add_reference(x2, x2, b))
        for o, r in zip(out, refs):
            torch.testing.assert_close(o.float(), r.float(), atol=2e-2, rtol=2e-2)
    print("OK", len(_launch._compiled))
""")


def test_fused_kernels_are_captured_and_replay_correctly_under_cuda_malloc_async():
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-c", SCRIPT, REPO], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-2000:] + p.stderr[-4000:]
