"""kvloop: an LLM inference engine in Python."""

import os
import sys
from typing import TYPE_CHECKING, Any

from kvloop.config import EngineConfig, ModelConfig
from kvloop.errors import InvalidParamsError, KvloopError, ModelLoadError, PromptTooLongError
from kvloop.params import SamplingParams  # none loads torch

# KVLOOP_ISA=avx2 (or scalar) stands for a CPU without AVX-512: the native kernels are
# built for it (kvloop.kernels.build), and so that an AVX-512 machine measures and tests
# what an AVX2-only one runs, the libraries under torch are held to it too: ATen's
# vectorized ops, oneDNN's GEMMs (its bf16 path among them) and MKL's. Each reads its
# variable once, when torch loads, so this must run first; a variable already set wins.
_LIBRARY_ISA = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "scalar": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
               "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}
if os.environ.get("KVLOOP_ISA") in _LIBRARY_ISA and "torch" not in sys.modules:
    for _name, _value in _LIBRARY_ISA[os.environ["KVLOOP_ISA"]].items():
        os.environ.setdefault(_name, _value)


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
