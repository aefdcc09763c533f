"""moekv: an inference engine for Mixture-of-Experts language models."""
from moekv.config import EngineConfig
from moekv.llm import LLM
from moekv.outputs import CompletionOutput, RequestOutput
from moekv.sampling_params import SamplingParams
from moekv.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig", "StructuredOutputsParams"]
__version__ = "0.1.0"
