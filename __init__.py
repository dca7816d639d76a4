"""SD Accel: ComfyUI entry point.

Guarded: whatever goes wrong while loading the pack, ComfyUI's own start-up goes on, with one log line
saying what is off. Imports nothing heavy at module level beyond what ComfyUI has already imported.
"""
import logging

WEB_DIRECTORY = "./js"
NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}

try:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F811
except Exception as _e:  # noqa: BLE001 - never fail the host's start-up
    logging.getLogger("sd_accel").error("[SD Accel] not loaded: %s: %s", type(_e).__name__, _e)

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
