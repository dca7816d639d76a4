"""What the kernels need to know about a CUDA device, read once per device and cached, so that an
eligibility check or a grid size costs no driver call."""
import torch

# Triton's interpreter (CI, TRITON_INTERPRET=1) runs on the CPU, which has no SMs: grids are sized as for a
# GPU of this many, so that CI runs the tilings of the large data-centre GPU the constants were tuned on.
SMS_WITHOUT_A_GPU = 132

_capability = {}    # device index -> (major, minor)
_sms = {}           # device index -> streaming multiprocessors
_async_alloc = []   # [bool] once read


def _index(device):
    return device.index if device.index is not None else torch.cuda.current_device()


def capability(device):
    """(major, minor) compute capability of CUDA `device`."""
    index = _index(device)
    if index not in _capability:
        _capability[index] = torch.cuda.get_device_capability(index)
    return _capability[index]


def sm_count(device):
    """Streaming multiprocessors of `device` (a torch.device): what the launchers size their grids by."""
    if device.type != "cuda":
        return SMS_WITHOUT_A_GPU
    index = _index(device)
    if index not in _sms:
        _sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sms[index]


def async_allocator():
    """True when PyTorch's CUDA allocator is cudaMallocAsync (ComfyUI's default on NVIDIA)."""
    if not _async_alloc:
        try:
            _async_alloc.append(torch.cuda.get_allocator_backend() == "cudaMallocAsync")
        except Exception:  # noqa: BLE001 - old torch or no CUDA: the native allocator
            _async_alloc.append(False)
    return _async_alloc[0]
