"""The server's turn memory (prompting/turn_memory.py): the next prompt of a conversation reuses
the tokens the model generated instead of a re-tokenization of their text.

Oracles: the tokenizer (spliced ids must decode to exactly the rendered text, and equal the
remembered prompt + output ids followed by the rendering's own tokens), and plain bookkeeping for
namespaces, breakpoints and the memory bounds.
"""
from __future__ import annotations

import pytest

from prefixserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from prefixserve.entrypoints.server.prompting.render_pool import RenderedChat
from prefixserve.entrypoints.server.prompting.turn_memory import TurnMemory
from prefixserve.prompt.breakpoints import Breakpoint
from prefixserve.tokenizer import load_tokenizer

TOK = load_tokenizer("random:qwen3-tiny")
EOT = TOK.eos_token_id  # <|im_end|>
PROMPT = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
REPLY = 'Paris: sunny, 21 degrees.'


def odd_tokens(text: str) -> list[int]:
    """A tokenization of `text` the tokenizer would not choose: one token per character."""
    ids = []
    for ch in text:
        ids += TOK.encode(ch)
    assert TOK.decode(ids) == text and ids != TOK.encode(text)
    return ids


def output(ids: list[int], reason: str = "stop") -> RequestOutput:
    return RequestOutput("r", None, [], 0, [CompletionOutput(0, TOK.decode(ids), ids, reason)], True,
                         RequestMetrics(arrival_time=0.0))


def rendered(text: str, breakpoints=()) -> RenderedChat:
    return RenderedChat(text, TOK.encode(text), list(breakpoints), None)


def remembered(memory: TurnMemory, namespace="t") -> tuple[list[int], list[int]]:
    prompt_ids = TOK.encode(PROMPT)
    reply_ids = odd_tokens(REPLY) + [EOT]
    memory.remember(namespace, PROMPT, prompt_ids, output(reply_ids), TOK)
    return prompt_ids, reply_ids


NEXT = PROMPT + REPLY + "<|im_end|>\n<|im_start|>user\nAnd Oslo?<|im_end|>\n<|im_start|>assistant\n"


def test_the_next_prompt_keeps_the_generated_tokens_and_its_text():
    memory = TurnMemory()
    prompt_ids, reply_ids = remembered(memory)
    plain = rendered(NEXT)
    spliced = memory.splice("t", plain, TOK)
    k = plain.token_ids.index(EOT, len(prompt_ids))   # the template's end of the reply
    assert spliced.token_ids == prompt_ids + reply_ids[:-1] + plain.token_ids[k:]
    assert TOK.decode(spliced.token_ids, skip_special_tokens=False) == NEXT
    assert spliced.text == NEXT


def test_another_namespace_never_gets_the_tokens():
    memory = TurnMemory()
    remembered(memory, namespace="tenant-a")
    plain = rendered(NEXT)
    assert memory.splice("tenant-b", plain, TOK) is plain
    assert memory.splice(None, plain, TOK) is plain


def test_breakpoints_after_the_turn_move_and_inside_it_cancel_the_splice():
    memory = TurnMemory()
    prompt_ids, reply_ids = remembered(memory)
    plain = rendered(NEXT)
    shift = len(reply_ids) - 1 - len(TOK.encode(REPLY))
    early = Breakpoint("messages[0]", "5m", 0, 3)
    late = Breakpoint("messages[2]", "5m", len(NEXT), len(plain.token_ids))
    spliced = memory.splice("t", rendered(NEXT, [early, late]), TOK)
    assert [b.num_tokens for b in spliced.breakpoints] == [3, len(plain.token_ids) + shift]
    inside = Breakpoint("messages[1]", "5m", 0, len(prompt_ids) + 2)
    assert memory.splice("t", rendered(NEXT, [inside]), TOK).token_ids == plain.token_ids


def test_only_turns_that_ended_on_an_end_of_turn_token_are_remembered():
    memory = TurnMemory()
    ids = odd_tokens(REPLY)
    memory.remember("t", PROMPT, TOK.encode(PROMPT), output(ids, "length"), TOK)
    memory.remember("t", PROMPT, TOK.encode(PROMPT), output(ids + [EOT], "abort"), TOK)
    assert memory.splice("t", rendered(NEXT), TOK).token_ids == TOK.encode(NEXT)


def test_memory_is_bounded_in_turns_and_tokens():
    memory = TurnMemory(max_turns=2, max_tokens=10_000)
    for i in range(3):
        memory.remember(f"ns{i}", PROMPT, TOK.encode(PROMPT), output(odd_tokens(REPLY) + [EOT]), TOK)
    assert memory.splice("ns0", rendered(NEXT), TOK).token_ids == TOK.encode(NEXT)   # evicted
    assert memory.splice("ns2", rendered(NEXT), TOK).token_ids != TOK.encode(NEXT)
    small = TurnMemory(max_turns=10, max_tokens=20)
    small.remember("t", PROMPT, TOK.encode(PROMPT), output(odd_tokens(REPLY) + [EOT]), TOK)
    assert small.splice("t", rendered(NEXT), TOK).token_ids == TOK.encode(NEXT)      # too long to keep
    with pytest.raises(ValueError):
        TurnMemory(max_turns=-1)


def test_a_tenant_flooding_the_memory_evicts_its_own_turns_not_another_tenants():
    # When full, the tenant holding the most gives up its least recently used turn, so a flood
    # by one tenant cannot push out the few turns of another (the old single LRU did).
    memory = TurnMemory(max_turns=8, max_tokens=10_000)
    prompt_ids = TOK.encode(PROMPT)
    reply_ids = odd_tokens(REPLY) + [EOT]
    memory.remember("zeta-ns", PROMPT, prompt_ids, output(reply_ids), TOK, tenant="zeta")
    for i in range(100):   # acme: 100 distinct turns, far past the 8 the memory holds
        text = f"<|im_start|>user\nFlood {i}?<|im_end|>\n<|im_start|>assistant\n"
        memory.remember(f"acme-{i % 3}", text, TOK.encode(text), output(odd_tokens(REPLY) + [EOT]), TOK,
                        tenant="acme")
    assert memory.splice("zeta-ns", rendered(NEXT), TOK).token_ids != TOK.encode(NEXT)   # still spliced
    last = "<|im_start|>user\nFlood 99?<|im_end|>\n<|im_start|>assistant\n"
    assert memory.splice("acme-0", rendered(last + REPLY + "<|im_end|>\n"), TOK).token_ids != \
        TOK.encode(last + REPLY + "<|im_end|>\n")                 # acme keeps its newest turns
    first = "<|im_start|>user\nFlood 0?<|im_end|>\n<|im_start|>assistant\n"
    assert memory.splice("acme-0", rendered(first + REPLY + "<|im_end|>\n"), TOK).token_ids == \
        TOK.encode(first + REPLY + "<|im_end|>\n")                # and gave up its oldest
