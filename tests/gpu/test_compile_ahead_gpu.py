"""GPU only: on a cold Triton cache, a step's fused kernels are compiled in parallel ahead of their first
launch (`_compile_ahead.run_compiling_ahead`, what every eager step goes through: engine/graphs/eager.eager_call),
the pass that compiled them ran the references, and the next pass runs every kernel, equal to them.
A subprocess with its own empty TRITON_CACHE_DIR, so nothing is compiled when it starts."""
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import sys, types, torch
    pkg = types.ModuleType("sd_accel"); pkg.__path__ = [sys.argv[1]]; sys.modules["sd_accel"] = pkg
    from sd_accel.kernels import _compile_ahead, _launch
    from sd_accel.kernels.group_norm_silu import group_norm_silu, group_norm_silu_reference
    from sd_accel.kernels.geglu import geglu, geglu_reference
    from sd_accel.kernels.layer_norm import layer_norm, layer_norm_reference
    from sd_accel.kernels.bias_residual_add import bias_residual_add, bias_residual_add_reference
    assert _compile_ahead.compile_ahead_available()
    dev, f16 = "cuda", torch.float16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(2, 320, 32, 32, device=dev, dtype=f16, generator=g).contiguous(memory_format=torch.channels_last)
    x2 = torch.randn(2, 320, 64, 64, device=dev, dtype=f16, generator=g).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(320, device=dev, dtype=f16, generator=g), torch.randn(320, device=dev, dtype=f16, generator=g)
    h = torch.randn(2, 1024, 2560, device=dev, dtype=f16, generator=g)
    t = torch.randn(2, 1024, 320, device=dev, dtype=f16, generator=g)
    ops = (group_norm_silu, geglu, layer_norm, bias_residual_add)

    def step():
        return (group_norm_silu(x, 32, w, b), group_norm_silu(x2, 32, w, b), geglu(h),
                layer_norm(t, (320,), w, b), bias_residual_add(x2, x2, b))
    refs = (group_norm_silu_reference(x, 32, w, b), group_norm_silu_reference(x2, 32, w, b), geglu_reference(h),
            layer_norm_reference(t, (320,), w, b), bias_residual_add_reference(x2, x2, b))

    out, compiled = _compile_ahead.run_compiling_ahead(step)
    assert compiled >= 5, compiled        # GroupNorm's two paths (one program per group; statistics + apply) and three more
    assert [f.last_call.path for f in ops] == ["reference"] * 4, [f.last_call.reason for f in ops]
    assert _compile_ahead._executor is not None
    out2, again = _compile_ahead.run_compiling_ahead(step)   # everything compiled: the plain call
    assert again == 0 and [f.last_call.path for f in ops] == ["triton"] * 4, [f.last_call.reason for f in ops]
    for o, r in zip(out2, refs):
        torch.testing.assert_close(o.float(), r.float(), atol=2e-2, rtol=2e-2)
    print("OK", compiled, round(_launch.first_launches["ahead_seconds"], 2))
""")


def test_a_cold_steps_kernels_are_compiled_ahead_in_parallel_then_run(tmp_path):
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync", TRITON_CACHE_DIR=str(tmp_path))
    env.pop("TRITON_INTERPRET", None)
    env.pop("SDACCEL_PARALLEL_COMPILE", None)
    p = subprocess.run([sys.executable, "-c", SCRIPT, REPO], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-2000:] + p.stderr[-4000:]
