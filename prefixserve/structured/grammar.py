"""Compiles StructuredOutputs into llguidance matchers for one tokenizer.

JSON is generated compactly with the separators Python's json.dumps writes (", " and ": ") and no
other whitespace: a random or weak model cannot pad the output with whitespace forever, and
arguments the template re-renders read exactly as json.dumps would write them.
"""
from __future__ import annotations

import json

import llguidance

from prefixserve.errors import InvalidRequestError
from prefixserve.structured.constraint import Constraint
from prefixserve.structured.spec import StructuredOutput

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_grammar(schema: dict) -> str:
    """An llguidance grammar for one JSON schema, generated compactly."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


def lark_json(schema: dict) -> str:
    """The `%json {...}` body of a Lark rule matching `schema`, generated compactly."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


class GrammarCompiler:
    """One per engine: the llguidance view of the tokenizer is built once (tens of ms).
    Thread-safe: llguidance compiles with the GIL released, and AsyncLLM compiles off the
    engine thread."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=sorted(eos_token_ids))

    def grammar_of(self, spec: StructuredOutput) -> str:
        if spec.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(spec.spec)
        if spec.kind == "json_object":
            return json_grammar({"type": "object"})
        try:
            schema = json.loads(spec.spec)
        except ValueError:
            raise InvalidRequestError("the JSON schema is not valid JSON",
                                      param="response_format") from None
        if not isinstance(schema, dict):
            raise InvalidRequestError("a JSON schema must be an object", param="response_format")
        return json_grammar(schema)

    def constraint(self, spec: StructuredOutput) -> Constraint:
        """A fresh matcher; InvalidRequestError naming llguidance's complaint when the grammar
        or schema cannot be compiled (an unsupported keyword, a malformed rule)."""
        grammar = self.grammar_of(spec)
        # No validate_grammar first: it compiles the grammar as well, doubling the cost, and the
        # matcher reports the same error.
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"the {spec.kind.replace('_', ' ')} cannot be compiled: "
                                      f"{matcher.get_error()[:500]}", param="response_format")
        return Constraint(matcher, self.vocab_size)
