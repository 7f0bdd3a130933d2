"""kvloop: an LLM inference engine in Python."""

from typing import TYPE_CHECKING, Any

from kvloop.config import EngineConfig, ModelConfig
from kvloop.errors import InvalidParamsError, KvloopError, ModelLoadError, PromptTooLongError
from kvloop.params import SamplingParams

if TYPE_CHECKING:
    from kvloop.engine.llm import LLM
    from kvloop.engine.llm_engine import LLMEngine
    from kvloop.engine.outputs import CompletionOutput, RequestOutput

_LAZY = {
    "LLM": "kvloop.engine.llm",
    "LLMEngine": "kvloop.engine.llm_engine",
    "CompletionOutput": "kvloop.engine.outputs",
    "RequestOutput": "kvloop.engine.outputs",
}


def __getattr__(name: str) -> Any:
    # The engine pulls in torch (~2 s): import it only when used, so `kvloop --help` and
    # a CLI usage error answer at once.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvloop' has no attribute {name!r}")


__all__ = [
    "LLM", "CompletionOutput", "EngineConfig", "InvalidParamsError", "KvloopError", "LLMEngine",
    "ModelConfig", "ModelLoadError", "PromptTooLongError", "RequestOutput", "SamplingParams",
]
__version__ = "0.1.0"
