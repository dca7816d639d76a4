"""The weights fingerprint (engine/graphs/fingerprint.py): what makes every graph of a model drop."""
import torch

from sd_accel.engine.graphs.fingerprint import WeightsFingerprint
from sd_accel.engine.memory import residency


def test_sees_replaced_inplace_and_inference_tensors():
    lin = torch.nn.Linear(4, 4)
    fp = WeightsFingerprint(lin)
    epoch = object()
    f0, _ = fp.read(epoch)
    assert fp.read(epoch)[0] == f0
    with torch.no_grad():
        lin.weight.add_(1)                      # in place: version counter moves
    f1, _ = fp.read(epoch)
    assert f1 != f0
    lin.weight = torch.nn.Parameter(lin.weight.detach().clone())   # replaced, as a LoRA patch does
    assert fp.read(epoch)[0] != f1
    with torch.inference_mode():                 # ComfyUI's weights are inference tensors
        inf = torch.nn.Linear(4, 4)
    fpi = WeightsFingerprint(inf)
    a, all_cuda = fpi.read(None)
    assert not all_cuda and a == fpi.read(None)[0]


def test_within_a_run_objects_and_versions_are_checked_and_data_swaps_wait_for_the_next_run():
    with torch.inference_mode():
        lin = torch.nn.Linear(4, 4)
    lin.register_buffer("table", torch.zeros(3))
    fp = WeightsFingerprint(lin)
    e = object()
    f0, _ = fp.read(e)
    lin.bias = torch.nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
    f1, _ = fp.read(e)
    assert f1 != f0                                 # replaced object: seen within the run
    lin.table.add_(1)
    f2, _ = fp.read(e)
    assert f2 != f1
    lin.table = None
    assert fp.read(e)[0] != f2
    plain = torch.nn.Linear(4, 4)
    fpp = WeightsFingerprint(plain)
    g0, _ = fpp.read(e)
    plain.weight.data = plain.weight.data.clone()  # same Parameter, new data (its version counter stays)
    assert fpp.read(e)[0] == g0, "within the run: not read again"
    assert fpp.read(object())[0] != g0, "the next run's first read sees it"


def test_an_object_patch_of_a_child_module_is_seen_at_the_next_run():
    """ModelSamplingDiscrete replaces the BaseModel's `model_sampling` (an object patch): the graphs of the
    eps model must not replay for the v-prediction one, even if the new module's buffers hold equal values."""
    class Sampling(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("sigmas", torch.linspace(0.1, 14.6, 10))

    class Base(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.diffusion_model = torch.nn.Linear(2, 2)
            self.model_sampling = Sampling()
    base = Base()
    fp = WeightsFingerprint(base, base.diffusion_model)
    f0, _ = fp.read(object())
    base.model_sampling = Sampling()
    assert fp.read(object())[0] != f0
    e = object()
    f1, _ = fp.read(e)
    residency.mark(base.diffusion_model)     # a block streamer's token: on the UNet
    assert fp.read(e)[0] != f1


def test_a_dead_modules_successor_never_matches_it():
    seq = torch.nn.Sequential(torch.nn.Linear(2, 2))
    fp = WeightsFingerprint(seq)
    f0, _ = fp.read(object())
    seq[0] = torch.nn.Linear(2, 2)
    import gc
    gc.collect()
    assert fp.read(object())[0] != f0


def test_a_tensor_freed_and_another_made_at_its_address_is_seen_within_the_run():
    """The per-step check compares the slots' objects by id(); a new tensor can take a freed one's id. The
    weakref callbacks mark the read stale when a tensor of it dies, so the check never mistakes the new one."""
    lin = torch.nn.Linear(4, 4)
    lin.register_buffer("table", torch.zeros(3))
    fp = WeightsFingerprint(lin)
    e = object()
    f0, _ = fp.read(e)
    old_id = id(lin.table)
    reused = None
    for _ in range(50):
        lin.table = None              # the old tensor's last reference: freed here
        new = torch.ones(3)
        lin.table = new
        if id(new) == old_id:
            reused = new
            break
        f0, _ = fp.read(e)            # not reused this time: start again from this tensor
        old_id = id(new)
        del new
    assert reused is not None, "CPython gave no freed tensor's address to a new one in 50 tries"
    assert fp.read(e)[0] != f0


def test_weights_made_under_inference_mode_and_moved_outside_it_are_read_without_a_version():
    """A module made under inference_mode (ComfyUI's loaders) and moved by `.to()` outside it (a pack that loads
    models off the executor's thread): its parameters are not inference tensors, yet their data is, and reading
    their version counter raises. The fingerprint and the derived fp8 copies read them as inference tensors
    (no version; the host's patch state covers in-place updates) instead of failing the step."""
    from sd_accel.engine.fp8 import weights
    from sd_accel.engine.tensor_version import version_of
    with torch.inference_mode():
        lin = torch.nn.Linear(4, 4)
    lin.to(torch.float16)
    assert not lin.weight.is_inference() and version_of(lin.weight) is None
    fp = WeightsFingerprint(lin)
    epoch = object()
    f0, _ = fp.read(epoch)
    assert fp.read(epoch)[0] == f0 and fp.read(None)[0] == f0
    lin.weight = torch.nn.Parameter(lin.weight.detach().clone(), requires_grad=False)
    assert fp.read(epoch)[0] != f0
    w8 = torch.nn.Parameter(torch.randn(4, 4).to(torch.float8_e4m3fn), requires_grad=False)
    with torch.inference_mode():
        w8.data = w8.data.clone()                    # the fp8 weight's data an inference tensor, the Parameter not
    assert version_of(w8) is None
    copy = weights.upcast_of(w8, torch.float16)[0]
    assert torch.equal(copy, w8.to(torch.float16)) and weights.upcast_of(w8, torch.float16)[0] is copy


def test_a_switch_between_train_and_eval_mode_is_seen_within_the_run_and_switching_back_matches_again():
    """A layer may compute otherwise in eval mode (ComfyUI's fp8_ops Linear multiplies in FP8 only there): a graph
    captured in one mode must not replay in the other, whether the model or its token module (the UNet) switches."""
    unet = torch.nn.Sequential(torch.nn.Linear(4, 4))
    base = torch.nn.Module()
    base.diffusion_model = unet
    fp = WeightsFingerprint(base, token_module=unet)
    e = object()
    f_train, _ = fp.read(e)
    assert fp.read(e)[0] == f_train
    unet.eval()                                     # the UNet alone, as a pack's `.eval()` on diffusion_model
    f_eval, _ = fp.read(e)
    assert f_eval != f_train
    base.eval()
    assert fp.read(e)[0] != f_eval
    base.train()
    assert fp.read(e)[0] == f_train
