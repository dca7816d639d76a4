"""The input-hint-block cache on its own: planning, hits, and every way a cached output must be dropped."""
import pytest
import torch
from torch import nn

from sd_accel.engine.patches import fused_modules as fm
from sd_accel.engine.patches import hint_cache as hc
from sd_accel.engine.patches import patching


class TimestepSeq(nn.Sequential):
    """Stands in for ldm's TimestepEmbedSequential: called as (x, emb, context, transformer_options)."""

    def forward(self, x, emb=None, context=None, transformer_options={}):  # noqa: B006 - ldm's signature
        for layer in self:
            x = layer(x)
        return x


class TinyControl(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.input_hint_block = TimestepSeq(nn.Conv2d(3, 8, 3, padding=1), nn.SiLU(),
                                            nn.Conv2d(8, 8, 3, padding=1, stride=2), nn.SiLU(),
                                            nn.Conv2d(8, 4, 3, padding=1))
        # a block that reads the timestep: never cached
        self.other_block = TimestepSeq(nn.Conv2d(4, 4, 1), nn.GroupNorm(2, 4))


@pytest.fixture
def model():
    return TinyControl().eval()


@pytest.fixture
def patched(model):
    plan = hc.plan_hint_cache(model)
    backup = patching.apply_patches(model, plan)
    yield model, plan["input_hint_block"]
    patching.restore(model, backup)


def _hint(seed=1, hw=16):
    return torch.rand(2, 3, hw, hw, generator=torch.Generator().manual_seed(seed))


def test_plan_only_timestep_free_blocks_and_keeps_parameter_names(model):
    names = [n for n, _ in model.named_parameters()]
    plan = hc.plan_hint_cache(model, prefix="control.")
    assert list(plan) == ["control.input_hint_block"]
    new = plan["control.input_hint_block"]
    assert isinstance(new, TimestepSeq) and fm.original_class(new) is TimestepSeq
    assert [n for n, _ in model.named_parameters()] == names, "planning must not modify the model"
    for (n0, p0), (n1, p1) in zip(model.input_hint_block.named_parameters(), new.named_parameters()):
        assert n0 == n1 and p0 is p1, "parameters must be shared under the same names"
    assert not hc.is_timestep_free(model.other_block)
    # re-planning an already patched tree builds a fresh stand-in for the host class
    patching.apply_patches(model, {"input_hint_block": new})
    again = hc.plan_hint_cache(model)["input_hint_block"]
    assert type(again) is type(new) and again is not new
    assert again.sdaccel_stats() == {"hits": 0, "misses": 0, "bypassed": 0}


def test_same_hint_is_computed_once_and_equals_stock(model):
    x = _hint()
    with torch.no_grad():
        ref = model.input_hint_block(x, None, None)
        plan = hc.plan_hint_cache(model)
        backup = patching.apply_patches(model, plan)
        try:
            outs = [model.input_hint_block(x, torch.randn(2, 5), torch.randn(2, 7, 3)) for _ in range(3)]
        finally:
            patching.restore(model, backup)
    cache = plan["input_hint_block"]
    assert cache.sdaccel_stats() == {"hits": 2, "misses": 1, "bypassed": 0}
    assert all(torch.equal(o, ref) for o in outs)
    assert type(model.input_hint_block) is TimestepSeq, "restore puts the original back"


def test_inference_tensors_without_version_counter_still_hit(patched):
    model, cache = patched
    with torch.inference_mode():
        x = _hint()
        a = model.input_hint_block(x, None, None)
        b = model.input_hint_block(x, None, None)
    assert a is b and cache.sdaccel_stats()["hits"] == 1


def test_a_new_hint_tensor_is_a_miss_even_with_equal_values(patched):
    model, cache = patched
    with torch.no_grad():
        x = _hint()
        a = model.input_hint_block(x, None, None)
        b = model.input_hint_block(x.clone(), None, None)
    assert cache.sdaccel_stats()["misses"] == 2 and torch.equal(a, b)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_new_view_of_the_same_hint_hits_and_other_data_misses(patched, mode):
    """ControlNet Union calls the block on `hint.unsqueeze(0)[0]`: a new view object at every step (under
    inference mode, which ComfyUI samples in, one that does not even record its base)."""
    model, cache = patched
    with mode():
        base = _hint(1, hw=16).unsqueeze(0).expand(2, -1, -1, -1, -1).clone()   # two hints, as a union's list
        a = model.input_hint_block(base.unsqueeze(0)[0][0], None, None)
        b = model.input_hint_block(base.unsqueeze(0)[0][0], None, None)       # a new view of the same data: a hit
        other = model.input_hint_block(base[1], None, None)                   # the same base, other data: a miss
        half = model.input_hint_block(base[0, :1], None, None)                # the same data, another shape: a miss
    assert cache.sdaccel_stats() == {"hits": 1, "misses": 3, "bypassed": 0}
    assert b is a and torch.equal(other, a) and torch.allclose(half, a[:1], atol=1e-6)


def test_a_write_through_another_view_of_the_hint_is_seen(patched):
    model, cache = patched
    base = _hint(1, hw=16).unsqueeze(0).expand(2, -1, -1, -1, -1).clone()
    with torch.no_grad():
        a = model.input_hint_block(base.unsqueeze(0)[0][1], None, None)
        base[1].copy_(_hint(2))                   # a view shares its base's version counter
        c = model.input_hint_block(base.unsqueeze(0)[0][1], None, None)
        ref = TimestepSeq.forward(model.input_hint_block, _hint(2))
    assert cache.sdaccel_stats() == {"hits": 0, "misses": 2, "bypassed": 0}
    assert torch.equal(c, ref) and not torch.equal(c, a)


def test_a_view_of_a_new_base_with_equal_values_is_a_miss(patched):
    model, cache = patched
    with torch.no_grad():
        model.input_hint_block(_hint(1).unsqueeze(0)[0], None, None)
        model.input_hint_block(_hint(1).unsqueeze(0)[0], None, None)
    assert cache.sdaccel_stats()["misses"] == 2


def test_changed_hint_invalidates(patched):
    model, cache = patched
    x = _hint(1)
    with torch.no_grad():
        a = model.input_hint_block(x, None, None)
        x.copy_(_hint(2))                          # in place: same object, new version
        b = model.input_hint_block(x, None, None)
        ref = TimestepSeq.forward(model.input_hint_block, _hint(2))
        c = model.input_hint_block(_hint(3, hw=24), None, None)    # another shape
    assert cache.sdaccel_stats() == {"hits": 0, "misses": 3, "bypassed": 0}
    assert not torch.equal(a, b) and torch.equal(b, ref)
    assert c.shape[-1] == 12


def test_changed_weights_invalidate(patched):
    model, cache = patched
    x = _hint()
    conv = model.input_hint_block[0]
    with torch.no_grad():
        a = model.input_hint_block(x, None, None)
        conv.weight.mul_(2)                        # in place (a weight patch written into the tensor)
        b = model.input_hint_block(x, None, None)
        conv.weight = nn.Parameter(conv.weight / 2)   # replaced (ComfyUI's set_attr_param)
        c = model.input_hint_block(x, None, None)
        conv.weight_function = [lambda w: w]       # ComfyUI's low-VRAM LoRA hook appears
        model.input_hint_block(x, None, None)
    assert cache.sdaccel_stats() == {"hits": 0, "misses": 4, "bypassed": 0}
    assert not torch.equal(a, b) and torch.equal(a, c)


def test_patched_or_training_calls_bypass_the_cache(patched):
    model, cache = patched
    x = _hint()
    with torch.no_grad():
        model.input_hint_block(x, None, None, {"patches": {"forward_timestep_embed_patch": []}})
        model.input_hint_block(x, None, None, transformer_options={"patches": {"x": []}})
    out = model.input_hint_block(x, None, None)    # autograd on, weights require grad
    assert out.requires_grad
    assert cache.sdaccel_stats() == {"hits": 0, "misses": 0, "bypassed": 3}


def test_clear_and_bounded_entries(patched):
    model, cache = patched
    hints = [_hint(i) for i in range(4)]
    with torch.no_grad():
        for h in hints:
            model.input_hint_block(h, None, None)
        assert len(cache._sdaccel_entries) == hc.MAX_ENTRIES
        model.input_hint_block(hints[-1], None, None)
        assert cache.sdaccel_stats()["hits"] == 1
        cache.clear()
        assert not cache._sdaccel_entries
        model.input_hint_block(hints[-1], None, None)
    assert cache.sdaccel_stats()["misses"] == 5
