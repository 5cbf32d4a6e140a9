"""The model runtime both pools share: model, weights, tokenizer, paged KV cache, scheduler."""

from engine.config import EngineConfig, ModelConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "ModelConfig", "RequestOutput", "SamplingParams"]
