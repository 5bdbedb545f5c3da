"""Structured output: a request's grammar (a JSON schema, any JSON object, or a Lark grammar)
compiled by llguidance into a matcher per sample, whose token mask the sampler applies to that
sample's logits row only.

`spec` is plain data that travels in SamplingParams; `grammar` compiles it against a tokenizer;
`constraint` follows one sample's output tokens; `mask` is the tensor op the sampler runs."""
from prefixserve.structured.spec import StructuredOutput

__all__ = ["StructuredOutput"]
