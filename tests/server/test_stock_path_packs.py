"""The eager stock path through the real server (CPU), with other packs' patch mechanisms in the graph.

Where no graph runs and the host is the bound, SD Accel's step runs the stock modules: on current ComfyUI the
UNet's folded blocks swapped back, for the call, to the originals they copy where the copies compute nothing else
(hosts/comfyui/stock_blocks.py); elsewhere, and in a block that holds another pack's module, the stand-ins' stock
branches. Both are stock's computation. Here the eager path is held to it (comfy_packs_stock), fused kernels on,
so every graph must give stock's output to the byte, in each order SD Accel meets the pack, and the pack must act.
The packs are the stand-ins of tests/packs (docs/other_packs.md); the graphs are test_other_packs.py's.
"""
import pytest
from test_other_packs import (ORDERS, _is_2024, ad_graph, animatediff, assert_changed, assert_matches, cn_graph,
                              detailer_graph, iclight_graph, ipadapter, model_graph, report_of, run_output)


def _stock_path_ran(entry):
    report = report_of(entry)
    why = report["fell_back"].get("fused kernels", "")
    assert "ran the stock modules" in why, report["fell_back"]


def _exact_in_orders(srv, build, orders=ORDERS, swapped=True):
    """`swapped`: the pack leaves SD Accel its module swaps (AnimateDiff's modules inside the UNet, where they
    cannot be ejected for planning (ComfyUI 2024), make it plan none: stock's modules then run anyway)."""
    ref, _ = run_output(srv, build("stock"))
    for order in orders:
        got, entry = run_output(srv, build(order))
        report_of(entry)
        if order == "ours" and swapped:
            _stock_path_ran(entry)
        assert_matches(got, ref, exact=True, what=order)
    return ref


def test_ipadapter_on_the_stock_path_is_stock_to_the_byte(comfy_packs_stock, models):
    nodes = [ipadapter()]
    ref = _exact_in_orders(comfy_packs_stock, lambda o: model_graph(models, nodes, o, True, prefix="sp_ipa"))
    plain, _ = run_output(comfy_packs_stock, model_graph(models, [], "stock", prefix="sp_ipa_none"))
    assert_changed(ref, plain, "the IPAdapter stand-in")


def test_animatediff_modules_in_the_blocks_run_on_the_stock_path(comfy_packs_stock, models):
    """AnimateDiff inserts its temporal modules into the UNet's blocks when its clone loads: into our folded
    copies where it loads ours, which the originals then lack (those blocks keep their copies), or into modules
    both share. After a stock run that left them in the originals, and in every order, stock's latent."""
    nodes = [animatediff(0, seed=6)]
    ref = _exact_in_orders(comfy_packs_stock, lambda o: ad_graph(models, nodes, o, True, "sp_ad"), swapped=False)
    plain, _ = run_output(comfy_packs_stock, ad_graph(models, [], "stock", True, "sp_ad_none"))
    assert_changed(ref, plain, "the motion modules")


def test_animatediff_v1_groupnorm_across_frames_on_the_stock_path(comfy_packs_stock, models):
    """v1 swaps the GroupNorm class's forward during the UNet call: the originals run it as stock does."""
    run_output(comfy_packs_stock, model_graph(models, [], "stock", prefix="sp_ad_v1_unload"))
    nodes = [animatediff(0, version="v1", seed=9)]
    got, entry = run_output(comfy_packs_stock, ad_graph(models, nodes, "ours", True, "sp_ad_v1"))
    report_of(entry)
    ref, _ = run_output(comfy_packs_stock, ad_graph(models, nodes, "stock", True, "sp_ad_v1"))
    assert_matches(got, ref, exact=True, what="ours")


def test_advanced_controlnet_on_the_stock_path_is_stock_to_the_byte(comfy_packs_stock, models):
    _exact_in_orders(comfy_packs_stock, lambda o: cn_graph(models, ["acn", "stock"], o, prefix="sp_acn"),
                     orders=("ours", "apply"))


def test_detailer_on_an_accelerated_model_on_the_stock_path_is_stock_to_the_byte(comfy_packs_stock, models):
    ref, _ = run_output(comfy_packs_stock, detailer_graph(models, "stock", prefix="sp_det"))
    got, entry = run_output(comfy_packs_stock, detailer_graph(models, "apply", prefix="sp_det"))
    report_of(entry)
    assert_matches(got, ref, exact=True, what="apply")


def test_iclight_on_the_stock_path_is_stock_to_the_byte(comfy_packs_stock, models):
    """IC-Light's padded input conv (a weight patch of another shape) and its extra_conds, on the originals the
    stock path swaps back: stock's image to the byte in every order, and the foreground acted."""
    if _is_2024(comfy_packs_stock):
        pytest.skip("IC-Light pads a weight through ComfyUI's pad_weight, which ComfyUI 2024 does not have")
    ref = _exact_in_orders(comfy_packs_stock, lambda o: iclight_graph(models, o, True, prefix="sp_icl"))
    other, _ = run_output(comfy_packs_stock, iclight_graph(models, "stock", True, multiplier=0.5, prefix="sp_icl_m"))
    assert_changed(ref, other, "IC-Light's foreground")
