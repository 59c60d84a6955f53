"""Inference: paged hybrid cache, continuous-batching engine, sampling, OpenAI-compatible server and CLI.

``Engine``, ``EngineConfig`` and ``SamplingParams`` are the entry points; ``openk3.infer.decode`` holds the decode
steps and their fast-path hooks. Imports are lazy so that ``openk3 --help`` stays quick.
"""

from __future__ import annotations

import importlib

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams", "load_for_inference"]

_WHERE = {
    "Engine": "openk3.infer.engine",
    "EngineConfig": "openk3.infer.engine",
    "RequestOutput": "openk3.infer.engine",
    "load_for_inference": "openk3.infer.engine",
    "SamplingParams": "openk3.infer.sampling",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'openk3.infer' has no attribute {name!r}")
