"""The model runtime both pools share: model, weights, tokenizer, paged KV cache, scheduler.

The names below load on first use (PEP 562), so a process that only needs a light
module of the package (the router's block hashes and tokenizer, the supervisor's
configs) does not import torch and the model code with it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig, ModelConfig
    from pdserve.engine.llm import LLM
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.outputs import RequestOutput
    from pdserve.engine.sampling_params import SamplingParams

_HOMES = {
    "EngineConfig": "config",
    "ModelConfig": "config",
    "LLM": "llm",
    "LLMEngine": "llm_engine",
    "RequestOutput": "outputs",
    "SamplingParams": "sampling_params",
}
__all__ = ["LLM", "LLMEngine", "EngineConfig", "ModelConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'pdserve.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pdserve.engine.{_HOMES[name]}"), name)
