"""What goes into a CUDA graph's key (engine/graphs/keys.py, tokens.py): everything that changes what a
captured step computes, and nothing that changes every step without changing it. Runs on any device."""
import gc
import weakref
import uuid

import torch

from sd_accel.engine.graphs import keys, tokens


def _key(obj):
    flat = keys.flatten(obj)
    return flat.tensors, flat.key


def _big(*shape):
    return torch.randn(*shape)   # more than SMALL_HOST_TENSOR elements: a graph input


def test_tensor_values_are_inputs_but_structure_and_shapes_are_key():
    a = {"x": _big(2, 4, 8, 8), "opts": {"cond_or_uncond": [1, 0], "ctx": _big(2, 77, 8)}, "n": 3}
    b = {"x": _big(2, 4, 8, 8), "opts": {"cond_or_uncond": [1, 0], "ctx": _big(2, 77, 8)}, "n": 3}
    ta, ka = _key(a)
    tb, kb = _key(b)
    assert ka == kb and len(ta) == 2
    assert _key({**b, "n": 4})[1] != ka                          # a non-tensor value changes the graph
    assert _key({**b, "x": _big(3, 4, 8, 8)})[1] != ka           # so does a shape
    assert _key({**b, "x": _big(2, 4, 8, 8).half()})[1] != ka    # a dtype
    assert _key({**b, "x": _big(2, 8, 8, 4).permute(0, 3, 1, 2)})[1] != ka   # and a layout (strides)


def test_the_process_gemm_switches_are_key():
    """A replay keeps its capture's GEMM kernels: with fp16 accumulation (KJNodes' loaders set it per model they load)
    or reduced-precision reductions flipped since, stock's next call runs others, so the key must change."""
    m = torch.backends.cuda.matmul
    call = {"x": _big(2, 4, 8, 8), "n": 3}
    before = _key(call)[1]
    for name in ("allow_fp16_accumulation", "allow_fp16_reduced_precision_reduction", "allow_tf32"):
        if not hasattr(m, name):
            continue
        old = getattr(m, name)
        setattr(m, name, not old)
        try:
            assert _key(call)[1] != before, name
        finally:
            setattr(m, name, old)
        assert _key(call)[1] == before, name


def test_the_process_attention_and_determinism_switches_are_key():
    """The SDPA backends torch may choose (a pack that turns flash attention off) and deterministic algorithms: a
    replay keeps the attention kernels and algorithms of its capture, so flipping one must give another key."""
    cuda = torch.backends.cuda
    call = {"x": _big(2, 4, 8, 8)}
    before = _key(call)[1]
    switches = [(cuda.flash_sdp_enabled, cuda.enable_flash_sdp), (cuda.math_sdp_enabled, cuda.enable_math_sdp),
                (cuda.mem_efficient_sdp_enabled, cuda.enable_mem_efficient_sdp),
                (torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms)]
    if hasattr(cuda, "cudnn_sdp_enabled"):
        switches.append((cuda.cudnn_sdp_enabled, cuda.enable_cudnn_sdp))
    for read, set_ in switches:
        old = read()
        set_(not old)
        try:
            assert _key(call)[1] != before, read.__name__
        finally:
            set_(old)
        assert _key(call)[1] == before, read.__name__


def test_patch_objects_by_identity_never_by_a_reusable_id():
    patch1, patch2 = (lambda q: q), (lambda q: q)
    assert _key({"p": patch1})[1] != _key({"p": patch2})[1]
    assert _key({"p": patch1})[1] == _key({"p": patch1})[1]
    # a patch that died and a new one (Python often puts it at the dead one's address) never look alike
    old_key = _key({"p": (lambda q: q * 2)})[1]
    gc.collect()
    for _ in range(50):
        fresh = lambda q: q * 3  # noqa: E731
        assert _key({"p": fresh})[1] != old_key
    assert tokens.dead_tokens(old_key) and not tokens.dead_tokens(_key({"p": patch1})[1])


def test_a_closures_numbers_are_content():
    """FreeU's b1/b2, a scale captured in a closure: the same function object with another value inside
    computes another graph."""
    def make():
        scale = [1.1]

        def patch(h):
            return h * scale[0]
        return patch, scale
    patch, scale = make()
    k1 = _key({"p": patch})[1]
    assert _key({"p": patch})[1] == k1
    scale[0] = 1.3
    assert _key({"p": patch})[1] != k1


def test_a_callable_objects_attributes_are_content():
    """IPAdapter-style patch objects keep their weights in attributes (and lists of dicts)."""
    class Replace:
        def __init__(self):
            self.kwargs = [{"weight": 1.0, "embeds": torch.ones(4)}]

        def __call__(self, q, k, v, extra):
            return q
    r = Replace()
    k1 = _key({"attn2": {("input", 1): r}})[1]
    r.kwargs[0]["weight"] = 0.5
    k2 = _key({"attn2": {("input", 1): r}})[1]
    r.kwargs[0]["embeds"] = torch.zeros(4)               # another tensor: read by address inside a graph
    k3 = _key({"attn2": {("input", 1): r}})[1]
    assert len({k1, k2, k3}) == 3


def test_bound_methods_are_their_object_and_function():
    class P:
        def patch(self, h):
            return h
    p = P()
    assert _key({"p": p.patch})[1] == _key({"p": p.patch})[1]   # a new bound-method object per access
    assert _key({"p": p.patch})[1] != _key({"p": P().patch})[1]


def test_our_own_objects_enter_by_their_options_whichever_object():
    def ours_a(x):
        return x

    def ours_b(x):
        return x
    ours_a.sd_accel_inert = ours_b.sd_accel_inert = ("apply_model", True, True, True, "auto")
    ours_b.__qualname__ = ours_a.__qualname__
    assert _key({"w": [ours_a]})[1] == _key({"w": [ours_b]})[1]
    ours_b.sd_accel_inert = ("apply_model", False, True, True, "auto")
    assert _key({"w": [ours_a]})[1] != _key({"w": [ours_b]})[1]


def test_uuids_enter_by_pattern_small_host_tensors_by_value():
    u, v = uuid.uuid4(), uuid.uuid4()
    t1, k1 = _key({"sample_sigmas": torch.tensor([14.6, 7.0, 0.0]), "uuids": [u, v]})
    t2, k2 = _key({"sample_sigmas": torch.tensor([14.6, 7.0, 0.0]), "uuids": [uuid.uuid4(), uuid.uuid4()]})
    assert not t1 and k1 == k2                               # every run's fresh uuids: the same graph
    assert _key({"uuids": [u, u]})[1] != _key({"uuids": [u, v]})[1]   # which conds are the same one: kept
    assert _key({"sample_sigmas": torch.tensor([14.6, 6.0, 0.0]), "uuids": [u, v]})[1] != k1


def test_rebuild_puts_static_tensors_back_in_place():
    obj = ({"x": torch.ones(300), "l": [torch.zeros(400), 5, None, torch.ones(2)]}, (torch.full((300,), 2.0),))
    tensors, _ = _key(obj)
    statics = [keys.static_copy(t) for t in tensors]
    out = keys.rebuild(obj, iter(statics))
    assert out[0]["x"] is statics[0] and out[0]["l"][0] is statics[1] and out[1][0] is statics[2]
    assert out[0]["l"][1:3] == [5, None] and out[0]["l"][3] is obj[0]["l"][3]


def test_state_of_sees_plain_objects_and_random_generators_the_key_does_not():
    import random

    class Holder:
        def __init__(self):
            self.rate = 0.0
            self.rng = random.Random(3)
    h = Holder()
    sig, state = tokens.signature(h), tokens.state_of(h)
    h.rate += 0.5
    assert tokens.signature(h) == sig and tokens.state_of(h) != state
    state = tokens.state_of(h)
    h.rng.random()
    assert tokens.state_of(h) != state


def test_walks_are_bounded_on_cycles_and_huge_objects():
    a = {}
    a["self"] = a
    big = list(range(100000))
    assert tokens.signature(lambda: (a, big)) is not None
    assert tokens.state_of({"a": a, "big": big}) is not None


def test_gpu_tensors_inside_objects_are_soft_inputs_by_shape():
    """A patch's tensors (IPAdapter's embeds) enter by shape and are collected, in walk order, for the replay to
    copy into the tensors the capture read (meta tensors stand for GPU ones here)."""
    embeds = torch.empty(2, 4, 8, device="meta")
    other = torch.empty(2, 4, 8, device="meta")

    def make(t):
        def patch(q):
            return q + t
        return patch
    p = make(embeds)
    a, b = keys.flatten({"p": p}), keys.flatten({"p": p})
    assert a.key == b.key and a.soft == [embeds] and a.soft[0] is embeds
    holder = [embeds]

    def patch2(q):
        return q + holder[0]
    k1 = keys.flatten({"p": patch2})
    holder[0] = other                        # the step stored another tensor of the same shape: same graph
    k2 = keys.flatten({"p": patch2})
    assert k1.key == k2.key and k2.soft[0] is other
    holder[0] = torch.empty(3, 4, 8, device="meta")
    assert keys.flatten({"p": patch2}).key != k1.key          # another shape: another graph


class _Hypernet:
    """A patch object holding its own layers, as ComfyUI's HypernetworkLoader builds it (a dict of dim ->
    ModuleList) and moves them with `.to()` (the host's `model_patches_to` at every load and unload)."""

    def __init__(self, layers):
        self.hypernet = {320: layers}
        self.strength = 1.0

    def __call__(self, q, k, v, extra_options):
        return q, k, v


def test_a_patchs_own_layers_are_soft_inputs_and_their_move_in_place_is_seen():
    """A patch's layers live outside the model, so the fingerprint never reads them. Their GPU weights are soft
    inputs (meta tensors stand for GPU ones), and a move of them in place (the same Parameter objects at new
    addresses, as `Module.to` does) is a change: a replay would read the old addresses."""
    layers = torch.nn.ModuleList([torch.nn.Linear(8, 2, device="meta"), torch.nn.Linear(2, 8, device="meta")])
    patch = _Hypernet(layers)
    call = {"transformer_options": {"patches": {"attn1_patch": [patch]}}}
    a, b = keys.flatten(call), keys.flatten(call)
    params = list(layers.parameters())
    assert a.key == b.key and len(a.soft) == 4 and all(x is y for x, y in zip(a.soft, params))
    cpu = torch.nn.Linear(8, 2)        # real storage, so the move gets a new address
    marks = keys.soft_marks(list(cpu.parameters()))
    assert keys.soft_changed(marks, list(cpu.parameters())) == []
    cpu.to(torch.float64)
    assert keys.soft_changed(marks, list(cpu.parameters())) == [0, 1]
    assert keys.soft_changed(marks, list(cpu.parameters())[:1]) == [0]     # another count: all changed
    # one module held by a patch on every block (IPAdapter's): its weights enter once per call
    blocks = {"patches_replace": {"attn2": {("input", i): _Hypernet(layers) for i in range(3)}}}
    assert len(keys.flatten(blocks).soft) == 4


def test_a_large_modules_weights_enter_by_the_first_one():
    """A module with more weights than a patch's own layers usually have (the model, or a part of its tree a patch
    holds) enters by its first weight: reading all of them per call would cost the host, and a move of the module
    moves that one too."""
    big = torch.nn.Sequential(*[torch.nn.Linear(2, 2, device="meta") for _ in range(tokens.MODULE_TENSORS)])
    flat = keys.flatten({"p": _Hypernet(big)})
    assert len(flat.soft) == 1 and flat.soft[0] is big[0].weight


def test_helper_closures_made_per_call_do_not_change_the_key():
    """ToMe's patch keeps the unmerge closure it made for this call in a cell of its own."""
    state = {"u": None}

    def merge_patch(q):
        def unmerge(x, idx=torch.zeros(3)):
            return x
        state["u"] = unmerge
        return q
    merge_patch(1)
    k1 = _key({"p": merge_patch})[1]
    merge_patch(1)
    assert _key({"p": merge_patch})[1] == k1


def test_plain_holders_enter_by_type_and_their_state_by_attributes():
    class Holder:
        def __init__(self, rate):
            self.rate = rate
    a, b = Holder(0.1), Holder(0.5)
    assert _key({"easycache": a})[1] == _key({"easycache": b})[1]
    assert tokens.state_of(a) != tokens.state_of(b)


def test_a_plain_holders_tensors_are_neither_key_nor_soft_inputs():
    """EasyCache's holder keeps the step's last tensors; wrappers outside the graph read it, so its tensors
    must not make every call recapture."""
    class Holder:
        def __init__(self):
            self.x_prev = torch.empty(1, 4, 8, 8, device="meta")

    def wrapper(executor, *args):
        return executor(*args)
    h = Holder()
    a = keys.flatten({"easycache": h, "wrappers": {"diffusion_model": {"easycache": [wrapper]}}})
    h.x_prev = torch.empty(1, 4, 8, 8, device="meta")
    b = keys.flatten({"easycache": h, "wrappers": {"diffusion_model": {"easycache": [wrapper]}}})
    assert a.key == b.key and a.soft == [] and b.soft == []


FLAG_SWITCH = True


class _Switches:
    on = True
    factor = 1.5


def test_a_patch_reading_a_flag_of_its_module_or_class_keys_on_the_flags_value():
    """Forge's built-in FreeU patch applies FreeU or not by a class attribute its denoiser callback sets before each
    step (the user's start/end schedule): neither the call's arguments nor the patch's closure change, so the key
    must read the flag itself, or a graph captured while FreeU was on replays it after the schedule ended."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "hosts", "a1111"))
    from forge_freeu_standin import FreeUScript, make_output_block_patch
    patch = make_output_block_patch(320, 1.3, 1.4, 0.9, 0.2)
    to = {"patches": {"output_block_patch": [patch]}}
    try:
        FreeUScript.doFreeU = True
        on = _key(to)[1]
        assert _key(to)[1] == on
        FreeUScript.end = 0.5
        FreeUScript.denoiser_callback(19, 20)      # past the schedule's end
        assert FreeUScript.doFreeU is False and _key(to)[1] != on
        FreeUScript.denoiser_callback(0, 20)
        assert _key(to)[1] == on
    finally:
        FreeUScript.doFreeU, FreeUScript.end = True, 1.0


def test_module_globals_and_class_attributes_a_patch_reads_are_key_others_are_not():
    global FLAG_SWITCH

    def patch(h):
        return h * _Switches.factor if FLAG_SWITCH and _Switches.on else h

    def other(h):
        return h

    class Replace:                                  # a patch object (IPAdapter-style) whose __call__ reads a flag
        def __call__(self, h):
            return h if _Switches.on else -h
    replace = Replace()
    r1 = _key({"r": replace})[1]
    _Switches.on = False
    try:
        assert _key({"r": replace})[1] != r1
    finally:
        _Switches.on = True
    k1 = _key({"p": patch, "q": other})[1]
    try:
        FLAG_SWITCH = False
        k2 = _key({"p": patch, "q": other})[1]
        FLAG_SWITCH = True
        _Switches.factor = 2.0
        k3 = _key({"p": patch, "q": other})[1]
        _Switches.factor = 1.5
        assert len({k1, k2, k3}) == 3
        assert _key({"p": patch, "q": other})[1] == k1
        _Switches.unread = 7                     # an attribute the patch never reads changes nothing
        assert _key({"p": patch, "q": other})[1] == k1
    finally:
        FLAG_SWITCH, _Switches.factor = True, 1.5


def test_a_container_past_the_walks_depth_enters_by_its_items_and_is_never_held():
    """Forge's reference-only (extensions-builtin/forge_preprocessor_reference, dfdcbab6): its attention patch closes
    over the preprocessor object, which keeps each layer's recorded `(k, v)` in a dict, a new tuple every step, one
    level past the key's walk. A tuple cannot be held weakly: keyed by its own identity, every step's key held that
    step's recorded features alive (on the GPU, for as long as the key is kept). Keyed by its items' identities it
    holds nothing, and a new tuple of the same tensors is the same key."""
    class Preprocessor:
        def __init__(self):
            self.is_recording_style, self.recorded_attn1 = False, {}

        def __call__(self, image):
            return image

        def patch(self):
            def attn1_proc(q, k, v, transformer_options):
                if self.is_recording_style:
                    self.recorded_attn1[transformer_options["block"]] = (k, v)
                    return q
                return q + self.recorded_attn1[transformer_options["block"]][0]
            return attn1_proc
    pre = Preprocessor()
    proc = pre.patch()
    k, v = torch.randn(4), torch.randn(4)
    pre.recorded_attn1[("input", 1)] = (k, v)
    key = _key({"patches_replace": {"attn1": proc}})[1]
    pre.recorded_attn1[("input", 1)] = (k, v)                 # a new tuple of the same tensors
    assert _key({"patches_replace": {"attn1": proc}})[1] == key
    pre.recorded_attn1[("input", 1)] = (torch.randn(4), v)    # another recording: another key
    assert _key({"patches_replace": {"attn1": proc}})[1] != key
    held = weakref.ref(k)
    del k
    gc.collect()
    assert held() is None                                     # the first key holds none of its tensors
    assert key != _key({"patches_replace": {"attn1": proc}})[1]


def test_at_the_bound_the_graphs_of_keys_that_can_never_match_go_first():
    """A user who changes a patch node's settings gets a new clone with new patch functions; the old ones die with
    the old clone, and a key holding them can never match again. When a new key needs room, those keys' graphs are
    dropped, not the graphs of the keys still in use (a hires fix's second size, say), which a clear of the whole
    pool would make the next prompt probe and capture again. With no dead key the bound still holds, as a clear."""
    from sd_accel.engine.graphs import step_graphs
    graphs = step_graphs.StepGraphs(torch.nn.Linear(2, 2), max_graphs=3)
    patch = lambda q: q  # noqa: E731 - a patch function of the clone in use
    in_use = [_key({"p": patch, "x": _big(1, 4, s, s)})[1] for s in (8, 16)]
    dropped = _key({"p": (lambda q: q * 2), "x": _big(1, 4, 8, 8)})[1]   # the patch of a clone already freed
    gc.collect()
    for k in in_use + [dropped]:
        graphs.entries[(k, ())] = step_graphs._Entry()
    graphs._make_room(_key({"p": patch, "x": _big(2, 4, 8, 8)})[1])
    assert [f[0] for f in graphs.entries] == in_use
    assert graphs.stats["invalidations"] == 0
    graphs.entries[(_key({"p": patch, "x": _big(2, 4, 8, 8)})[1], ())] = step_graphs._Entry()
    graphs._make_room(_key({"p": patch, "x": _big(3, 4, 8, 8)})[1])
    assert not graphs.entries and graphs.stats["invalidations"] == 1
