"""The channels_last SpatialTransformer stand-in on ComfyUI's real SpatialTransformer (CPU): same output
as the host's forward for NCHW and channels_last input, output keeps the input's memory format (the
host's forward returns NCHW), same parameter names and children, planned only where the host forward is
the one it reproduces."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import comfy_inproc  # noqa: E402

from sd_accel.engine import layout_modules  # noqa: E402


@pytest.fixture(scope="module")
def unet(tmp_path_factory):
    return comfy_inproc.tiny_model_patcher(tmp_path_factory.mktemp("ckpt")).model.diffusion_model


def _transformers(unet):
    return [(n, m) for n, m in unet.named_modules() if type(m).__name__ == "SpatialTransformer"]


def test_stand_in_matches_host_forward_and_keeps_channels_last(unet):
    name, st = _transformers(unet)[0]
    new = layout_modules.make_channels_last_spatial_transformer(st)
    assert new is not None and isinstance(new, type(st))
    assert [n for n, _ in new.named_parameters()] == [n for n, _ in st.named_parameters()]
    assert all(a is b for a, b in zip(new.parameters(), st.parameters()))
    c = st.norm.num_channels
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, c, 6, 5, generator=g)
    ctx = torch.randn(2, 7, st.transformer_blocks[0].attn2.to_k.in_features, generator=g)
    with torch.no_grad():
        for xin in (x, x.contiguous(memory_format=torch.channels_last)):
            ref = st(xin, context=ctx, transformer_options={})
            to = {}
            out = new(xin, context=ctx, transformer_options=to)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            assert to["block_index"] == len(st.transformer_blocks) - 1
        assert out.is_contiguous(memory_format=torch.channels_last)
        assert not ref.is_contiguous(memory_format=torch.channels_last), "the host's forward returns NCHW"


def test_plan_covers_every_transformer_and_leaves_the_tree_alone(unet):
    before = dict(unet.named_modules())
    plan = layout_modules.plan_layout_patches(unet, prefix="diffusion_model.")
    assert sorted(plan) == sorted("diffusion_model." + n for n, _ in _transformers(unet))
    assert dict(unet.named_modules()) == before


def test_an_unknown_host_forward_is_not_replaced():
    class SpatialTransformer(torch.nn.Module):   # same name, another forward: left alone
        def __init__(self):
            super().__init__()
            self.norm = self.proj_in = self.proj_out = torch.nn.Identity()
            self.transformer_blocks = torch.nn.ModuleList()
            self.use_linear = False

        def forward(self, x, context=None):
            return x
    assert layout_modules.make_channels_last_spatial_transformer(SpatialTransformer()) is None
