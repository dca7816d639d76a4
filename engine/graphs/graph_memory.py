"""The memory CUDA graphs hold under cudaMallocAsync (ComfyUI's default allocator), and giving back what no live
graph uses.

Under cudaMallocAsync a capture's allocations become the graph's own memory, held by the driver's graph memory
pool, not by torch's allocator. cudaMemGetInfo, which ComfyUI's `get_free_memory` reads, counts it as used, so
ComfyUI sees it; but destroying a graph returns its memory to that pool, not to the device, until
cudaDeviceGraphMemTrim gives it back. torch binds neither call: they go through the CUDA runtime torch has
loaded. Under torch's native allocator graphs use a private pool of torch's own instead (torch counts it
reserved and inactive, which ComfyUI takes for free memory), and the driver's graph pool stays empty.
"""
import ctypes

import torch

_RESERVED_MEM_CURRENT = 2     # cudaGraphMemAttrReservedMemCurrent
_RUNTIMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so", "cudart64_13.dll", "cudart64_12.dll")
_CUDART = []


def _cudart():
    if not _CUDART:
        lib = None
        for name in _RUNTIMES:
            try:
                lib = ctypes.CDLL(name)
                lib.cudaDeviceGraphMemTrim, lib.cudaDeviceGetGraphMemAttribute
                break
            except (OSError, AttributeError):
                lib = None
        _CUDART.append(lib)
    return _CUDART[0]


def _index(device):
    if device is None:
        return torch.cuda.current_device()
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def async_allocator():
    """True where torch allocates through cudaMallocAsync (graphs' memory is then the driver's graph memory)."""
    return torch.cuda.is_available() and torch.cuda.get_allocator_backend() == "cudaMallocAsync"


def reserved_bytes(device=None):
    """Bytes the driver holds for graphs on `device`, in use or not; None without CUDA or a reachable runtime."""
    lib = _cudart() if torch.cuda.is_available() else None
    if lib is None:
        return None
    val = ctypes.c_uint64(0)
    rc = lib.cudaDeviceGetGraphMemAttribute(ctypes.c_int(_index(device)), ctypes.c_int(_RESERVED_MEM_CURRENT),
                                            ctypes.byref(val))
    return int(val.value) if rc == 0 else None


def trim(device=None):
    """Gives the driver's graph memory that no live graph uses back to the device; False where it could not."""
    lib = _cudart() if torch.cuda.is_available() else None
    if lib is None:
        return False
    torch.cuda.synchronize(device)
    return lib.cudaDeviceGraphMemTrim(ctypes.c_int(_index(device))) == 0
