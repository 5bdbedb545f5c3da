"""Per-request sampling and stopping parameters.

Plain data shared by the engine, the scheduler (which needs max_tokens and the
stop ids) and the sampler, so it imports nothing heavier than the standard
library. Every value is checked when the object is built, and the error
(an InvalidRequestError) names the field in `param`, because these values
arrive straight from HTTP clients.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from prefixserve.errors import InvalidRequestError
from prefixserve.structured.spec import StructuredOutput

# Integers reach torch as int64 and native kernels as int32: anything larger is a client mistake.
MAX_INT = 2**31 - 1
# every step scans new text for each stop string: bounded, so one request cannot slow the step
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: Optional[int] = None  # None: none; k >= 0: sampled token plus the k most likely
    skip_special_tokens: bool = True
    # A grammar the output must match (response_format, tool calls); None: unconstrained.
    structured: Optional[StructuredOutput] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check_int("n", self.n, low=1, high=128)
        _check_num("temperature", self.temperature, low=0.0, high=100.0)
        _check_num("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=-1, high=MAX_INT)
        _check_num("min_p", self.min_p, low=0.0, high=1.0)
        _check_num("repetition_penalty", self.repetition_penalty, low=0.0, high=100.0, low_open=True)
        _check_num("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_num("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=-(2**63), high=2**63 - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1, high=MAX_INT)
        _check_int("min_tokens", self.min_tokens, low=0, high=MAX_INT)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                param="min_tokens")
        if len(self.stop) > MAX_STOP_STRINGS or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings and {MAX_STOP_TOKEN_IDS} "
                                      "stop token ids", param="stop" if len(self.stop) > MAX_STOP_STRINGS
                                      else "stop_token_ids")
        for s in self.stop:
            if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
                raise InvalidRequestError(f"stop must hold strings of 1-{MAX_STOP_CHARS} characters, "
                                          f"got {str(s)[:40]!r}", param="stop")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0, high=MAX_INT)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=20)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidRequestError("structured must be a StructuredOutput", param="structured")
        if self.structured is not None and (self.ignore_eos or self.min_tokens):
            # the grammar decides where the output ends: nothing may be sampled after that
            raise InvalidRequestError("ignore_eos and min_tokens cannot be combined with a grammar "
                                      "(response_format or a forced tool call)",
                                      param="ignore_eos" if self.ignore_eos else "min_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _check_int(name: str, value: object, *, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise InvalidRequestError(f"{name} must be in [{low}, {high}], got {value}", param=name)


def _check_num(name: str, value: object, *, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", param=name)
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise InvalidRequestError(f"{name} must be in {bracket}{low}, {high}], got {value}", param=name)
