"""Host adapters: how each host (ComfyUI, A1111) applies the engine's patches its own reversible way."""
