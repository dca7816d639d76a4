import os

# ComfyUI's main.py (cuda_malloc.py) selects this allocator before torch is imported; torch refuses a
# different backend once CUDA is initialised, so it must be set before anything imports torch.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
