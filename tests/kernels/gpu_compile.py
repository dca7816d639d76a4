"""Compiles the kernels the launchers would launch, for an NVIDIA target, on a machine without a GPU.

The interpreter (what CI runs) executes the kernels' Python, so it misses what only the compiler sees
(types, constexpr arithmetic, loop-carried values) and says nothing about registers. This script records
the launches each op's `_launch` makes for a set of calls on CPU tensors (the real launch is replaced by
a recorder), binds and specialises them as Triton's own JIT would for the GPU, compiles each for sm_90
with Triton's bundled ptxas, and prints one JSON line per distinct kernel variant: its name, the
constexprs, and the registers / stack (spills) that cuobjdump reports.

Run by tests/kernels/test_gpu_compile.py in a subprocess: TRITON_INTERPRET must be unset before Triton
is imported, and pytest's conftest sets it.
"""
import json
import os
import subprocess
import sys
import tempfile
import types

os.environ.pop("TRITON_INTERPRET", None)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "sd_accel" not in sys.modules:
    pkg = types.ModuleType("sd_accel")
    pkg.__path__ = [REPO]
    sys.modules["sd_accel"] = pkg

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from sd_accel.kernels import add_layer_norm as aln  # noqa: E402
from sd_accel.kernels import bias_residual_add as bra  # noqa: E402
from sd_accel.kernels import group_norm_silu as gn  # noqa: E402
from sd_accel.kernels import layer_norm as ln  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
CL = torch.channels_last


def _x(shape, dtype=torch.float16, cl=False):
    x = torch.randn(shape).to(dtype)
    return x.contiguous(memory_format=CL) if cl else x


def calls():
    """(label, fn) pairs; each fn runs one op's `_launch` on CPU tensors."""
    out = []
    for shape in ((2, 320, 64, 64), (2, 640, 32, 32), (2, 1280, 16, 16), (2, 2560, 8, 8), (2, 320, 32, 32),
                  (1, 960, 96, 96), (2, 2560, 16, 16), (3, 96, 1, 1), (1, 160, 7)):
        for cl in ((False, True) if len(shape) == 4 else (False,)):
            C = shape[1]
            x = _x(shape, cl=cl)
            w, b = torch.randn(C, dtype=torch.float16), torch.randn(C, dtype=torch.float16)
            add = torch.randn(shape[0], C)
            out.append((f"gn {shape} cl={cl}", lambda x=x, w=w, b=b, add=add: gn._launch(x, 32, w, b, 1e-5, "silu", add)))
    for shape, groups, cl in (((2, 160, 5, 5), 1, True), ((2, 48, 5, 5), 48, False), ((1, 64, 45, 45), 32, False)):
        x = _x(shape, torch.float32, cl)
        out.append((f"gn {shape} groups={groups} cl={cl}", lambda x=x, g=groups: gn._launch(x, g, None, None, 1e-6, None)))
    for shape, xcl, rcl in (((2, 320, 64, 64), True, True), ((2, 1280, 8, 8), False, False),
                            ((2, 640, 32, 32), True, False), ((1, 3, 5, 7), False, True), ((2, 160, 7), False, False)):
        x, r = _x(shape, cl=xcl), _x(shape, cl=rcl)
        b, rb = torch.randn(shape[1], dtype=torch.float16), torch.randn(shape[1])
        out.append((f"bias_residual_add {shape} {xcl} {rcl}", lambda x=x, r=r, b=b, rb=rb: bra._launch(x, r, b, rb, x)))
        out.append((f"bias_residual_add {shape} no bias", lambda x=x, r=r: bra._launch(x, r, None, None, None)))
    for shape in ((2, 4096, 320), (2, 1024, 640), (2, 256, 1280), (2, 4096, 640), (1, 7, 33)):
        a, r = _x(shape), _x(shape)
        w, b = torch.randn(shape[-1], dtype=torch.float16), torch.randn(shape[-1], dtype=torch.float16)
        out.append((f"add_layer_norm {shape}", lambda a=a, r=r, w=w, b=b: aln._launch(a, r, w, b, 1e-5)))
        out.append((f"layer_norm {shape}", lambda a=a, w=w, b=b: ln._launch(a, w, b, 1e-5)))
    return out


def record_launches():
    seen = []

    def recorder(kernel, grid, *args, **meta):
        seen.append((kernel, grid, args, meta))
    for mod in (gn, bra, aln, ln):
        mod.launch = recorder
    for label, fn in calls():
        fn()
    return seen


def _resources(cubin):
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    res = {}
    for line in text.splitlines():
        for field in line.split():
            key, _, val = field.partition(":")
            if key in ("REG", "STACK", "LOCAL", "SHARED") and val.isdigit():
                res[key.lower()] = int(val)
    return res


def main():
    backend = make_backend(TARGET)
    done = set()
    for kernel, grid, args, meta in record_launches():
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, spec, options = binder(*args, **meta)
        options, signature, constexprs, attrs = kernel._pack_args(backend, meta, bound, spec, options)
        key = (kernel.__name__, str(signature), str(sorted(constexprs.items())), str(sorted(attrs.items())),
               meta.get("num_warps"))
        if key in done:
            continue
        done.add(key)
        compiled = compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
        names = kernel.arg_names
        consts = {names[k[0]]: v for k, v in constexprs.items() if len(k) == 1}
        print(json.dumps({"kernel": kernel.__name__, "grid": list(grid), "num_warps": meta.get("num_warps"),
                          "constexprs": {k: v for k, v in consts.items() if isinstance(v, (int, float, bool))},
                          **_resources(compiled.asm["cubin"])}), flush=True)


if __name__ == "__main__":
    main()
