"""The capturability probe (engine/graphs/probe.py, host_reads.py, rng.py): a key's first, eager call decides
whether a CUDA graph could reproduce the step, so no capture is ever tried that would fail or replay wrong.
On the CPU the probe watches CPU values (`host_reads.WATCHED`), standing for the GPU's."""
import random

import pytest
import torch

from sd_accel.engine.graphs import eager, host_reads, probe
from sd_accel.kernels import _triton


@pytest.fixture(autouse=True)
def watch_cpu(monkeypatch):
    monkeypatch.setattr(host_reads, "WATCHED", "cpu")


def _probe(fn, *args, **kwargs):
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    return probe.probe(fn, args, kwargs, inputs)


def test_a_plain_step_is_capturable_and_its_result_is_the_calls():
    x = torch.randn(8)
    out, v = _probe(lambda x: x * 2, x)
    assert v.capturable and v.input_reads == () and torch.equal(out, x * 2)


def test_reading_an_input_on_the_host_is_capturable_per_value():
    """Kohya Deep Shrink: `transformer_options["sigmas"][0].item()`, a view of the step's timestep."""
    x, sigmas = torch.randn(8), torch.tensor([14.6, 14.6])

    def step(x, sigmas):
        return x * 0.5 if sigmas[0].item() > 10 else x
    out, v = _probe(step, x, sigmas)
    assert v.capturable and v.input_reads == (1,) and torch.equal(out, x * 0.5)


def test_inside_a_capture_input_reads_are_answered_from_the_host_copy():
    static = torch.zeros(3)
    seen = []
    with host_reads.HostReads([static], {0: torch.tensor([7.0, 8.0, 9.0])}):
        seen.append(static[1].item())
        seen.append(bool(static[2] > 0))      # a computed value: not an input, passes through to torch
    assert seen == [8.0, False]


def test_reading_a_value_computed_in_the_step_is_refused_and_says_where():
    """EasyCache: `(timestep[0] > self.end_t).item()`: a decision on a value the step computes."""
    x = torch.randn(8)

    def easycache_like(x):
        if (x.abs().mean() > 0.1).item():
            return x
        return x * 0
    _, v = _probe(easycache_like, x)
    assert not v.capturable and "reads a GPU value on the host (item at test_probe.py" in v.reason
    assert "easycache_like" in v.reason


def test_changing_python_state_is_refused_and_names_the_object():
    calls = []

    def counting(x, transformer_options):
        calls.append(1)
        return x
    counting.__qualname__ = "counting_patch"
    _, v = _probe(lambda x, to: to["patches"]["p"][0](x, to), torch.ones(4),
                  {"patches": {"p": [counting]}})
    assert not v.capturable and "changes Python state between calls (counting_patch)" in v.reason

    class Holder:
        rate = 0.0
    h = Holder()

    def accumulate(x, to):
        to["holder"].rate += 1.0
        return x
    _, v = _probe(accumulate, torch.ones(4), {"holder": h})
    assert not v.capturable and "Holder" in v.reason


def test_a_patch_modules_call_counter_is_python_state():
    """ControlNet-LLLite (kohya-ss's ComfyUI nodes, Forge's built-in copy): its attention patch object holds its
    layers, each an nn.Module counting its calls in `current_step` to stay silent outside the user's start/end
    steps. A replay would neither read nor advance the counter, so such a call is refused; a module whose numbers
    stay (a plain patch layer) is not."""
    class LLLiteLike(torch.nn.Module):
        def __init__(self, start, end, steps):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.start_step, self.end_step, self.num_steps, self.current_step = start, end, steps, 0

        def forward(self, x):
            on = self.start_step <= self.current_step < self.end_step
            self.current_step = (self.current_step + 1) % self.num_steps
            return self.proj(x) if on else torch.zeros_like(x)

    class Patch:
        def __init__(self, modules):
            self.modules = modules

        def __call__(self, q, extra):
            return q + self.modules["to_q"](q)

    def step(x, to):
        return to["patches"]["attn1_patch"][0](x, to)
    with torch.no_grad():
        counting = Patch({"to_q": LLLiteLike(0, 3, 10)})
        _, v = _probe(step, torch.ones(2, 4), {"patches": {"attn1_patch": [counting]}})
        assert not v.capturable and "Patch" in v.reason, v.reason
        plain = Patch({"to_q": torch.nn.Linear(4, 4)})
        _, v = _probe(step, torch.ones(2, 4), {"patches": {"attn1_patch": [plain]}})
        assert v.capturable, v.reason


def test_state_set_and_reset_within_the_call_is_not_a_change():
    """HyperTile keeps the tile layout in a closure between its in- and out-patches of one call."""
    temp = [None]

    def patch_in(x):
        temp[0] = (2, 2)
        return x

    def patch_out(x):
        temp[0] = None
        return x
    _, v = _probe(lambda x, p: p[1](p[0](x)), torch.ones(4), [patch_in, patch_out])
    assert v.capturable


def test_host_random_draws_are_allowed_only_where_the_result_ignores_them():
    x = torch.randn(8)

    def draws_but_ignores(x):
        torch.randint(0, 1, (1,))           # HyperTile's one-candidate draw: always 0
        random.random()
        return x + 1

    def draws_and_uses(x):
        return x * torch.rand(1)
    cpu_before = torch.default_generator.get_state()
    out, v = _probe(draws_but_ignores, x)
    assert v.capturable and v.note and torch.equal(out, x + 1)
    ref = torch.Generator().set_state(cpu_before)
    torch.randint(0, 1, (1,), generator=ref)
    assert torch.equal(torch.default_generator.get_state(), ref.get_state()), "left as one stock call leaves it"
    _, v = _probe(draws_and_uses, x)
    assert not v.capturable and "random" in v.reason


def test_compiling_ahead_never_runs_a_stateful_call_twice(monkeypatch):
    """A pass that compiled kernels is normally repeated on the compiled kernels; a call that keeps state
    (a cache wrapper) must run once per step, as in stock."""
    monkeypatch.setattr(_triton, "compile_ahead_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(_triton, "run_compiling_ahead", lambda f: (f(), 3))   # every pass "compiles"
    calls = []

    def cache_wrapper(x):
        calls.append(1)          # state kept between calls, in the wrapper's closure
        return x
    _probe(lambda x, to: to["wrappers"][0](x), torch.ones(2), {"wrappers": [cache_wrapper]})
    assert len(calls) == 1
    plain = []
    _probe(lambda x: plain.append(1) or x, torch.ones(2))
    assert len(plain) == eager.AHEAD_PASSES + 1     # a pure call: passes, then the plain call


def test_a_stateful_call_or_explicit_wait_is_found(monkeypatch):
    """torch.cuda.synchronize() is not covered by torch's sync debug mode: watched by the probe (waits.py)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)   # the CPU has none to call

    def waits(x):
        torch.cuda.synchronize()
        return x
    _, v = _probe(waits, torch.ones(3))
    assert not v.capturable and "torch.cuda.synchronize at test_probe.py" in v.reason


def test_random_draws_leave_the_generators_as_one_stock_call_does(monkeypatch):
    """Compile-ahead may run the call several times; the result and the generator are one call's."""
    monkeypatch.setattr(_triton, "compile_ahead_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(_triton, "run_compiling_ahead", lambda f: (f(), 3))
    x = torch.randn(4)
    torch.manual_seed(11)
    ref = x * torch.rand(4)
    after_one = torch.default_generator.get_state()
    torch.manual_seed(11)
    out, v = _probe(lambda x: x * torch.rand(4), x)
    assert not v.capturable and torch.equal(out, ref)
    assert torch.equal(torch.default_generator.get_state(), after_one)


def test_a_helper_closure_made_per_call_is_not_python_state():
    """ToMe's merge patch stores the unmerge function it made into a cell its output patch reads in the same
    call: a new function each call, never read across calls (its first call sets the cell: a StepGraphs key
    is probed twice, so that first change does not count; here the patch has run once already)."""
    def make(ratio=0.3):
        unmerge = None

        def tome_in(x):
            nonlocal unmerge
            idx = torch.randperm(4)

            def unmerge_fn(y):
                return y[..., idx.argsort()]
            unmerge = unmerge_fn
            return x
        return tome_in
    patch = make()
    patch(torch.ones(4))
    _, v = _probe(lambda x, to: to["patches"]["attn1_patch"][0](x), torch.ones(4),
                  {"patches": {"attn1_patch": [patch]}})
    assert v.capturable, v.reason


def test_watches_put_back_exactly_what_was_there_and_stay_on_their_thread():
    import threading
    from sd_accel.engine.graphs.waits import Waits
    sync = torch.cuda.synchronize
    seen = []
    x = torch.ones(3)
    with host_reads.HostReads([x]) as watch, Waits(raise_=False):
        assert "item" in vars(torch.Tensor) and torch.cuda.synchronize is not sync
        th = threading.Thread(target=lambda: seen.append(x[0].item()))    # another thread: straight to torch
        th.start()
        th.join()
        x[1].item()
    assert seen == [1.0] and watch.input_reads == {0}
    assert "item" not in vars(torch.Tensor), "an inherited method is inherited again, not pinned"
    assert torch.cuda.synchronize is sync


def _unet_like(x, control):
    """ComfyUI's UNet consumes its control: apply_control pops each block's residual off the lists."""
    for name in ("output", "input"):
        while control.get(name):
            ctrl = control[name].pop()
            if ctrl is not None:
                x = x + ctrl
    return x


def _control():
    return {"input": [torch.full((4,), 1.0), None, torch.full((4,), 2.0)], "output": [torch.full((4,), 4.0)]}


def test_a_step_run_again_by_compile_ahead_sees_the_control_it_was_given(monkeypatch):
    """Every compile-ahead pass and the plain call after them get the residuals, not the lists the first pass
    emptied (the T2I adapter's first run with graphs was off by the adapter's whole effect)."""
    monkeypatch.setattr(_triton, "compile_ahead_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(_triton, "run_compiling_ahead", lambda f: (f(), 3))   # every pass "compiles"
    control = _control()
    lists = (control["input"], control["output"])
    out, v = _probe(_unet_like, torch.zeros(4), control)
    assert v.capturable and torch.equal(out, torch.full((4,), 7.0)), out
    assert control["input"] is lists[0] and control["output"] is lists[1] and not any(lists), \
        "the containers end as one stock call leaves them"


def test_a_step_run_again_from_the_generators_start_sees_the_control_it_was_given():
    """A step that draws random numbers runs once more from the generators' start (probe._once_from)."""
    x = torch.zeros(4)

    def draws_and_consumes(x, control):
        torch.randint(0, 1, (1,))
        return _unet_like(x, control)
    out, v = _probe(draws_and_consumes, x, _control())
    assert v.capturable and torch.equal(out, torch.full((4,), 7.0)), out
