"""Structured outputs: a spec (pure Python), its compiled grammar, a per-sequence matcher.

The grammar library is imported only with the compiler (`from jaxserve.structured.compiler import
GrammarCompiler`), so SamplingParams and the server's request parsing can use the spec alone.

What an engine does with them:
- once: `compiler = GrammarCompiler.for_tokenizer(tok, vocab_size, eos_token_ids=engine_eos)`,
  exposed as `engine.grammar_compiler` (the server compiles each request's spec there before
  admitting it, so a bad one is a 400 and the engine finds it cached);
- per request with `params.structured_outputs`: `fut = compiler.submit(spec)`; schedule the
  request only once `fut.done()` (`fut.result()` raises the UserError of a bad spec), then give
  each of its n sequences `fut.result().matcher()` (after a preemption that dropped its state:
  `.matcher(output_token_ids)`);
- per step, before dispatch: `BitmaskFiller.fill([matcher or None per row], bitmask)` into an
  i32[S, ceil(V/32)] array; when it returns True, the sampler applies
  `runtime.bitmask.apply_token_bitmask` to the logits (after penalties and bias, before sampling);
- per sampled token: `ok = matcher.accept(token)` (skip EOS); when `matcher.is_terminated()`
  (or not ok, a bug) the sequence finishes with "stop", the token kept.
"""

from jaxserve.structured.spec import StructuredOutputs, ToolCallSpec

__all__ = ["StructuredOutputs", "ToolCallSpec"]
