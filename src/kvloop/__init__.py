"""kvloop: an LLM inference engine in Python."""

from kvloop.config import EngineConfig, ModelConfig
from kvloop.engine.llm import LLM
from kvloop.engine.llm_engine import LLMEngine
from kvloop.engine.outputs import CompletionOutput, RequestOutput
from kvloop.errors import InvalidParamsError, KvloopError, ModelLoadError, PromptTooLongError
from kvloop.params import SamplingParams

__all__ = [
    "LLM", "CompletionOutput", "EngineConfig", "InvalidParamsError", "KvloopError", "LLMEngine",
    "ModelConfig", "ModelLoadError", "PromptTooLongError", "RequestOutput", "SamplingParams",
]
__version__ = "0.1.0"
