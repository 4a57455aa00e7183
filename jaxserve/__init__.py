"""jaxserve: LLM inference and serving on JAX/XLA.

    from jaxserve import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    print(llm.generate("The capital of France is", SamplingParams(max_tokens=16))[0].outputs[0].text)
"""

import os as _os

__version__ = "0.1.0"

# jaxserve uses transformers only for tokenizers and chat templates; without torch installed it
# would print an advisory on every start. Users can still raise the verbosity themselves.
_os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.outputs import CompletionOutput, RequestOutput  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402


def __getattr__(name):  # heavy imports (jax, the model) only when asked for
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    if name == "LLMEngine":
        from jaxserve.engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
