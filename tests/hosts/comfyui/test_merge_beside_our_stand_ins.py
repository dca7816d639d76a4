"""A model merge patches every weight of the UNet, the norms' too, which SD Accel's stand-ins hold. ComfyUI
applies a clone's weight patches by replacing the Parameter objects along the module tree it finds loaded, and
restores its backup the same way. A stand-in planned while a merged clone was loaded, or kept across prompts, must
see every such replacement as stock's module does: else the next patch starts from the merge's tensors and the
unpatch leaves them in place, and stock's own images come out wrong after ours ran once. In process, through
ComfyUI's own ModelMergeSimple and sampler, on both ComfyUIs; the sequence a user makes by queueing prompts."""
import importlib

import torch

import comfy_inproc


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_stock_and_ours_after_a_merge_each_sample_their_own_weights(tmp_path):
    model = comfy_inproc.tiny_model_patcher(tmp_path / "ckpt")     # ComfyUI importable from here on
    model2 = comfy_inproc.tiny_model_patcher(tmp_path / "ckpt", seed=6)
    from sd_accel.hosts.comfyui import accelerate as host
    merge_node = importlib.import_module("comfy_extras.nodes_model_merging").ModelMergeSimple()
    with torch.inference_mode():
        merged = merge_node.merge(model, model2, 0.6)[0]
    sample = comfy_inproc.sample_tiny

    plain_ref, merged_ref = sample(model), sample(merged)
    assert _rel(merged_ref, plain_ref) > 0.05, "the merge moves the latent too little to test"
    ours, info = host.accelerate(merged, host.AccelOptions())     # planned while the merge's weights are applied
    assert info["patched"].get("group_norm_silu"), info["patched"]
    first = sample(ours)
    plain_again, merged_again = sample(model), sample(merged)
    second = sample(ours)                                          # the same stand-ins, another prompt
    ours_plain = sample(host.accelerate(model, host.AccelOptions())[0])
    stock_plain = sample(model)

    assert torch.equal(plain_again, plain_ref) and torch.equal(stock_plain, plain_ref), \
        ("stock's plain model after ours", _rel(plain_again, plain_ref), _rel(stock_plain, plain_ref))
    assert torch.equal(merged_again, merged_ref), ("stock's merge after ours", _rel(merged_again, merged_ref))
    for name, got, ref in (("ours, merge", first, merged_ref), ("ours, merge again", second, merged_ref),
                           ("ours, plain", ours_plain, plain_ref)):
        assert _rel(got, ref) < 1e-3, (name, _rel(got, ref), "vs the other model", _rel(got, plain_ref if ref is
                                                                                           merged_ref else merged_ref))
