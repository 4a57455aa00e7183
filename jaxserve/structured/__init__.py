"""Structured outputs: a spec (pure Python), its compiled grammar, a per-sequence matcher.

The grammar library is imported only with the compiler (`from jaxserve.structured.compiler import
GrammarCompiler`), so SamplingParams and the server's request parsing can use the spec alone.
"""

from jaxserve.structured.spec import StructuredOutputs, ToolCallSpec

__all__ = ["StructuredOutputs", "ToolCallSpec"]
