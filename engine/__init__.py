"""The model runtime both pools share: model, weights, tokenizer, paged KV cache, scheduler."""

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "ModelConfig", "RequestOutput", "SamplingParams"]
