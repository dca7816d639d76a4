"""`_launch.launch`: the compiled-kernel cache that lets Triton kernels run inside a CUDA-graph capture
under cudaMallocAsync (raw addresses skip the launcher's pointer check). The bookkeeping runs on CPU
with a stand-in kernel that records its launches; the real launch under capture is in tests/gpu."""
import pytest
import torch

from sd_accel.kernels import _compile_ahead, _device, _launch


class _Compiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        assert len(grid) == 3, "triton's CompiledKernel runner indexes grid[0..2]"
        return lambda *args: self.log.append(("raw", grid, args))


class _Kernel:
    """Stands in for a triton JITFunction: `kernel[grid](*args, **meta)` compiles and returns the compiled kernel."""
    arg_names = ["X", "Y", "N", "EPS", "BLOCK"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.log.append(("jit", grid, args, meta))
            return _Compiled(self.log)
        return run


@pytest.fixture
def gpu_like(monkeypatch):
    monkeypatch.setattr(_launch, "_compiled_launch_applies", lambda t: True)
    monkeypatch.setattr(_launch, "_compiled", {})
    state = {"capturing": False, "async": True}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(_device, "async_allocator", lambda: state["async"])
    return state


def test_first_call_compiles_then_later_calls_launch_raw_addresses_in_declaration_order(gpu_like):
    k, x, y = _Kernel(), torch.zeros(8), torch.zeros(8)
    _launch.launch(k, (2,), x, y, 8, 1e-5, BLOCK=4, num_warps=4)
    assert [e[0] for e in k.log] == ["jit"]
    x2, y2 = torch.ones(8), torch.ones(8)
    _launch.launch(k, (2,), x2, y2, 8, 1e-5, BLOCK=4, num_warps=4)
    assert k.log[-1] == ("raw", (2, 1, 1), (x2.data_ptr(), y2.data_ptr(), 8, 1e-5, 4))


def test_a_new_shape_or_meta_parameter_compiles_again(gpu_like):
    k, x, y = _Kernel(), torch.zeros(8), torch.zeros(8)
    _launch.launch(k, (2,), x, y, 8, 1e-5, BLOCK=4, num_warps=4)
    _launch.launch(k, (4,), x, y, 16, 1e-5, BLOCK=4, num_warps=4)
    _launch.launch(k, (2,), x, y, 8, 1e-5, BLOCK=8, num_warps=4)
    _launch.launch(k, (2,), x.half(), y.half(), 8, 1e-5, BLOCK=4, num_warps=4)
    assert [e[0] for e in k.log] == ["jit"] * 4


def test_capture_under_cuda_malloc_async_needs_an_earlier_eager_compile(gpu_like):
    k, x, y = _Kernel(), torch.zeros(8), torch.zeros(8)
    gpu_like["capturing"] = True
    with pytest.raises(_launch.NotWarmedUp):
        _launch.launch(k, (2,), x, y, 8, 1e-5, BLOCK=4, num_warps=4)
    assert k.log == []                      # nothing launched into the capture
    gpu_like["async"] = False               # native allocator: Triton's own launch works in a capture
    _launch.launch(k, (2,), x, y, 8, 1e-5, BLOCK=4, num_warps=4)
    gpu_like["async"] = True                # compiled now: raw launch inside the capture
    _launch.launch(k, (2,), x, y, 8, 1e-5, BLOCK=4, num_warps=4)
    assert [e[0] for e in k.log] == ["jit", "raw"]


def test_a_call_that_does_not_name_every_parameter_is_never_cached(gpu_like):
    k, x, y = _Kernel(), torch.zeros(8), torch.zeros(8)
    for _ in range(2):
        _launch.launch(k, (2,), x, y, 8, 1e-5, num_warps=4)   # BLOCK left to a default
    assert [e[0] for e in k.log] == ["jit", "jit"]


def test_ops_fall_back_to_their_reference_when_a_capture_finds_no_compiled_kernel(monkeypatch):
    from sd_accel.kernels import geglu as geglu_mod

    def not_warm(*a, **k):
        raise _launch.NotWarmedUp("x")
    monkeypatch.setattr(geglu_mod, "launch", not_warm)
    h = torch.randn(3, 8)
    out = geglu_mod.geglu(h)
    assert geglu_mod.geglu.last_call.path == "reference" and "capture" in geglu_mod.geglu.last_call.reason
    torch.testing.assert_close(out, geglu_mod.geglu_reference(h))


# ---- compiling ahead (run_compiling_ahead): the bookkeeping, with stand-ins for Triton's async mode ----------

class FutureKernel:   # the name Triton's _async_compile gives a compilation still on the pool
    kernel = None


class _AheadKernel(_Kernel):
    def __init__(self, cached=False):
        super().__init__()
        self.cached, self.warmups = cached, []
        self.future = FutureKernel()   # Triton keeps a submitted compilation's future in its kernel cache

    def warmup(self, *args, grid, **meta):
        self.warmups.append(args)
        return _Compiled(self.log) if self.cached else self.future


class _Mode:
    """Stands in for triton's AsyncCompileMode: entering and leaving are recorded."""
    events = []

    def __init__(self, executor, ignore_errors=False):
        self.ignore_errors = ignore_errors

    def __enter__(self):
        _Mode.events.append("enter")
        return self

    def __exit__(self, *exc):
        _Mode.events.append("exit (waits for the pool)")


@pytest.fixture
def ahead(gpu_like, monkeypatch):
    _Mode.events = []
    monkeypatch.setattr(_compile_ahead, "compile_ahead_available", lambda: True)
    monkeypatch.setattr(_compile_ahead, "_async_compile_mode", lambda: _Mode)
    return gpu_like


def test_compiling_ahead_submits_uncompiled_kernels_and_their_ops_run_the_reference(ahead):
    cold, warm = _AheadKernel(cached=False), _AheadKernel(cached=True)
    x, y = torch.zeros(8), torch.zeros(8)
    seen = []

    def step():
        for k in (cold, warm, cold):
            try:
                _launch.launch(k, (2,), x, y, 8, 1e-5, BLOCK=4, num_warps=4)
                seen.append("kernel")
            except _compile_ahead.CompilingAhead as e:
                seen.append(e.reason)
        return "out"

    out, compiled = _compile_ahead.run_compiling_ahead(step)
    assert out == "out" and compiled == 1            # one kernel, submitted once although reached twice
    assert seen == ["its kernel is being compiled ahead", "kernel", "its kernel is being compiled ahead"]
    assert cold.log == [] and [e[0] for e in warm.log] == ["jit"]   # nothing launched for the cold one
    assert _Mode.events == ["enter", "exit (waits for the pool)"]
    assert not _compile_ahead.compiling_ahead()
    # afterwards (the compilation done) the plain launch compiles/loads as usual
    _launch.launch(cold, (2,), x, y, 8, 1e-5, BLOCK=4, num_warps=4)
    assert [e[0] for e in cold.log] == ["jit"]


def test_when_everything_is_compiled_the_pass_is_the_plain_call(ahead):
    warm = _AheadKernel(cached=True)
    x, y = torch.zeros(8), torch.zeros(8)
    out, compiled = _compile_ahead.run_compiling_ahead(
        lambda: _launch.launch(warm, (2,), x, y, 8, 1e-5, BLOCK=4, num_warps=4) or "done")
    assert (out, compiled) == ("done", 0) and [e[0] for e in warm.log] == ["jit"]


def test_compiling_ahead_is_a_plain_call_where_unavailable_and_when_nested(ahead, monkeypatch):
    cold = _AheadKernel(cached=False)
    x, y = torch.zeros(8), torch.zeros(8)

    def step():
        _launch.launch(cold, (2,), x, y, 8, 1e-5, BLOCK=4, num_warps=4)
        return "ran"
    monkeypatch.setattr(_compile_ahead, "compile_ahead_available", lambda: False)
    assert _compile_ahead.run_compiling_ahead(step) == ("ran", 0) and cold.warmups == []
    monkeypatch.setattr(_compile_ahead, "compile_ahead_available", lambda: True)
    inner = []
    outer = _compile_ahead.run_compiling_ahead(lambda: inner.append(_compile_ahead.run_compiling_ahead(lambda: "inner")))
    assert inner == [("inner", 0)] and outer == (None, 0) and _Mode.events == ["enter", "exit (waits for the pool)"]


def test_a_failure_while_compiling_ahead_hands_over_to_the_plain_path(ahead):
    cold = _AheadKernel(cached=False)
    x, y = torch.zeros(8), torch.zeros(8)

    def step():
        try:
            _launch.launch(cold, (2,), x, y, 8, 1e-5, BLOCK=4, num_warps=4)
        except _compile_ahead.CompilingAhead:
            pass
        raise RuntimeError("a compilation failed")
    out, compiled = _compile_ahead.run_compiling_ahead(step)
    assert out is None and compiled == 1 and not _compile_ahead.compiling_ahead()
    with pytest.raises(RuntimeError):            # nothing pending: the error is the function's own
        _compile_ahead.run_compiling_ahead(lambda: (_ for _ in ()).throw(RuntimeError("own")))


def test_compiling_ahead_never_runs_inside_a_capture(ahead):
    cold = _AheadKernel(cached=False)
    x, y = torch.zeros(8), torch.zeros(8)
    ahead["capturing"] = True
    with pytest.raises(_launch.NotWarmedUp) as e:
        _compile_ahead.run_compiling_ahead(lambda: _launch.launch(cold, (2,), x, y, 8, 1e-5, BLOCK=4, num_warps=4))
    assert type(e.value) is _launch.NotWarmedUp and cold.warmups == []


def test_group_norms_split_path_submits_both_its_kernels_when_compiling_ahead(monkeypatch):
    """The statistics kernel still compiling must not hide the apply kernel from the pass that compiles ahead:
    both are submitted, and the op runs its reference for the call."""
    from sd_accel.kernels import group_norm_silu as gn
    attempted = []

    def compiling(kernel, grid, *args, **meta):
        attempted.append(kernel.__name__ if hasattr(kernel, "__name__") else str(kernel))
        raise _compile_ahead.CompilingAhead("x")
    monkeypatch.setattr(gn, "launch", compiling)
    x = torch.randn(2, 320, 64, 64).contiguous(memory_format=torch.channels_last)
    assert not gn.one_program_per_group(320, 64 * 64, 32)
    out = gn.group_norm_silu(x, 32)
    assert [a.split(":")[-1].strip(")").split(".")[-1] for a in attempted] == ["_gn_stats_kernel", "_gn_apply_kernel"]
    assert gn.group_norm_silu.last_call.path == "reference"
    assert gn.group_norm_silu.last_call.reason == _compile_ahead.CompilingAhead.reason
    torch.testing.assert_close(out, gn.group_norm_silu_reference(x, 32))


def test_launchers_of_the_kernels_compiled_ahead_are_built_on_the_pool(monkeypatch):
    """Each kernel compiled ahead and not yet loaded gets its host launcher built once (into Triton's cache);
    a loaded one, or a future that failed, is left alone; a failing build is left to the first launch."""
    import types
    triton = pytest.importorskip("triton")
    import triton.runtime
    built = []

    def launcher_cls(src, metadata):
        built.append(src)
        if src == "bad":
            raise RuntimeError("no compiler")
    monkeypatch.setattr(triton.runtime, "driver", types.SimpleNamespace(active=types.SimpleNamespace(
        launcher_cls=launcher_cls)), raising=False)
    fk = lambda kernel: types.SimpleNamespace(kernel=kernel)  # noqa: E731
    k = lambda src, module=None: types.SimpleNamespace(src=src, metadata={}, module=module)  # noqa: E731
    mode = types.SimpleNamespace(future_kernels={1: fk(k("a")), 2: fk(k("b", module="loaded")), 3: fk(None),
                                                 4: fk(k("bad")), 5: fk(k("c"))})
    _compile_ahead._prepare_launchers(mode)
    assert sorted(built) == ["a", "bad", "c"]
