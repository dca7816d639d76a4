"""Host-agnostic SD Accel engine: patch planning, CUDA-graph replay, offload, memory pool, condition
cache. Imports nothing from ComfyUI or A1111; each host passes in what it needs (weight casting,
module paths) and applies the returned patches its own reversible way."""
