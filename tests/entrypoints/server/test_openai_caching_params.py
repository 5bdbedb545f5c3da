"""OpenAI's caching fields on chat completions, through the official openai client against a live
server (random:qwen3-tiny, blocks of 16 tokens).

Oracles: the tokenizer (where a marked part ends in the rendered prompt, counted independently of
the server's breakpoint locator), the rule that usage's read + written + uncached tokens add up
to the prompt, and the KV manager's own integrity audit.
"""
from __future__ import annotations

import random

import pytest

MODEL = "random:qwen3-tiny"
BS = 16
WORDS = "cache block prefix pin evict token request server engine model prompt memory".split()


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def rendered(tokenizer, system: str, user: str) -> str:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def marked_prefix(tokenizer, system: str, user: str) -> int:
    """Prompt tokens up to the end of the system text: the rendered text cut there, tokenized,
    must be a token prefix of the whole prompt (the cut falls between tokens)."""
    text_ = rendered(tokenizer, system, user)
    end = text_.index(system) + len(system)
    head = tokenizer.encode(text_[:end], add_special_tokens=False)
    assert tokenizer.encode(text_, add_special_tokens=False)[:len(head)] == head
    return len(head)


def full_blocks_shared(tokenizer, system: str, users: tuple[str, str]) -> int:
    """What automatic caching alone serves the second prompt after the first: the full blocks of
    their common token prefix (never the second's last token)."""
    a, b = (tokenizer.encode(rendered(tokenizer, system, u), add_special_tokens=False) for u in users)
    common = 0
    while common < min(len(a), len(b) - 1) and a[common] == b[common]:
        common += 1
    return common // BS * BS


def unaligned_system(tokenizer, seed: int, users: tuple[str, str] = ("q", "r")) -> tuple[str, int]:
    """A system text whose marked prefix ends inside a block, past the full blocks the two user
    messages' prompts share: only a token-exact hit can serve it whole."""
    for words in range(40, 120):
        system = text(seed, words)
        t = marked_prefix(tokenizer, system, users[0])
        if t % BS and full_blocks_shared(tokenizer, system, users) < t:
            return system, t
    raise AssertionError("no unaligned system text found")


def ask(client, system: str, user: str, **kw):
    part = {"type": "text", "text": system, "prompt_cache_breakpoint": {"mode": "explicit"}}
    return client.chat.completions.create(
        model=MODEL, max_tokens=2, temperature=0.0,
        messages=[{"role": "system", "content": [part]}, {"role": "user", "content": user}], **kw)


def adds_up(usage) -> None:
    d = usage.prompt_tokens_details
    assert d.cached_tokens >= 0 and d.cache_write_tokens >= 0
    assert d.cached_tokens + d.cache_write_tokens <= usage.prompt_tokens


@pytest.fixture()
def tokenizer(server):
    return server.async_llm.tokenizer


def test_a_breakpoint_inside_a_block_is_read_back_to_the_token(client, server, tokenizer):
    users = ("What is a block?", "And a pin, and an eviction?")
    system, t = unaligned_system(tokenizer, 1, users)
    first = ask(client, system, users[0], prompt_cache_key="agent-1")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # written: the marked prefix, to the token, which this request computed itself
    assert first.usage.prompt_tokens_details.cache_write_tokens == t
    second = ask(client, system, users[1], prompt_cache_key="agent-1")
    assert second.usage.prompt_tokens_details.cached_tokens == t
    assert second.usage.prompt_tokens_details.cache_write_tokens == 0
    for r in (first, second):
        adds_up(r.usage)
    # the pins hold their blocks; nothing else is left in use
    stats = server.in_engine(lambda e: (e.kv.check_integrity(), e.kv.stats())[1])
    assert stats.num_used_blocks == stats.num_pinned_blocks


def test_without_the_mark_only_full_blocks_are_read(client, tokenizer):
    users = ("first question", "another one")
    system, t = unaligned_system(tokenizer, 2, users)
    ask(client, system, users[0])
    plain = client.chat.completions.create(
        model=MODEL, max_tokens=2, temperature=0.0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": users[1]}])
    assert plain.usage.prompt_tokens_details.cached_tokens == full_blocks_shared(tokenizer, system, users) < t


def test_explicit_mode_writes_only_the_marked_prefix(client, tokenizer):
    user = text(33, 200)   # many blocks after the mark
    system, t = unaligned_system(tokenizer, 3)
    explicit = {"mode": "explicit"}
    first = ask(client, system, user, prompt_cache_options=explicit)
    again = ask(client, system, user, prompt_cache_options=explicit)
    # the same prompt again: only the marked prefix was ever written
    assert again.usage.prompt_tokens_details.cached_tokens == t
    assert first.usage.prompt_tokens_details.cache_write_tokens == t
    # implicit (the default) caches the whole prompt as always: all but the last token's block
    ask(client, system, user)
    implicit = ask(client, system, user)
    n = implicit.usage.prompt_tokens
    assert implicit.usage.prompt_tokens_details.cached_tokens == (n - 1) // BS * BS


def test_retention_and_ttls_set_the_pin(http, tokenizer):
    system, _ = unaligned_system(tokenizer, 4)
    body = {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "system", "content": [{"type": "text", "text": system,
                                        "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}}]},
        {"role": "user", "content": [{"type": "text", "text": "hi",
                                      "prompt_cache_breakpoint": {"mode": "explicit"}}]}]}
    marks = http.post("/v1/chat/completions", json=body).json()["prefixserve"]["cache_breakpoints"]
    assert [(m["ttl"], m["ttl_seconds"]) for m in marks] == [("12h", 43200.0), ("30m", 1800.0)]
    long = http.post("/v1/chat/completions", json={**body, "prompt_cache_retention": "24h"}).json()
    assert {m["ttl_seconds"] for m in long["prefixserve"]["cache_breakpoints"]} == {86400.0}


@pytest.mark.parametrize("change, param", [
    ({"prompt_cache_options": {"mode": "sometimes"}}, "prompt_cache_options.mode"),
    ({"prompt_cache_options": {"ttl": "5m"}}, "prompt_cache_options.ttl"),
    ({"prompt_cache_options": {"mode": "explicit", "tll": "30m"}}, "prompt_cache_options.tll"),
    ({"prompt_cache_options": "explicit"}, "prompt_cache_options"),
    ({"prompt_cache_retention": "1w"}, "prompt_cache_retention"),
    ({"prompt_cache_key": ""}, "prompt_cache_key"),
    ({"prompt_cache_key": 7}, "prompt_cache_key"),
    ({"mark": {"mode": "implicit"}}, "messages[0].content[0].prompt_cache_breakpoint.mode"),
    ({"mark": {"mode": "explicit", "ttl": "1h"}}, "messages[0].content[0].prompt_cache_breakpoint.ttl"),
    ({"mark": {"mode": "explicit", "tl": "30m"}}, "messages[0].content[0].prompt_cache_breakpoint.tl"),
    ({"mark": "explicit"}, "messages[0].content[0].prompt_cache_breakpoint"),
    ({"both": True}, "messages[0].content[0].prompt_cache_breakpoint"),
])
def test_bad_values_are_a_400_naming_the_field(http, change, param):
    part = {"type": "text", "text": "You are terse."}
    change = dict(change)
    if "mark" in change:
        part["prompt_cache_breakpoint"] = change.pop("mark")
    if change.pop("both", False):
        part.update(prompt_cache_breakpoint={"mode": "explicit"}, cache_control={"type": "ephemeral"})
    body = {"model": MODEL, "max_tokens": 1, **change,
            "messages": [{"role": "system", "content": [part]}, {"role": "user", "content": "hi"}]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200


def test_completions_take_the_key_and_the_mode(http, tokenizer):
    """A text prompt has no marks: explicit mode writes nothing of it, implicit caches it."""
    prompt = text(40, 120)
    n = len(tokenizer.encode(prompt))

    def cached(**fields) -> int:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                "prompt_cache_key": "batch-7", **fields})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert [cached(prompt_cache_options={"mode": "explicit"}) for _ in range(2)] == [0, 0]
    assert [cached(), cached()] == [0, (n - 1) // BS * BS]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "prompt_cache_retention": "1d"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_retention"


def test_the_clients_typed_fields_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "hi"}],
        prompt_cache_key="k", prompt_cache_retention="in_memory",
        prompt_cache_options={"mode": "implicit", "ttl": "30m"})
    assert r.usage.prompt_tokens_details.cache_write_tokens == 0


def test_the_field_names_and_values_match_the_installed_client():
    """The names and values this server takes are the ones the openai client's types declare."""
    from typing import get_args, get_type_hints

    from openai.types.chat import completion_create_params as params
    from openai.types.chat.chat_completion_content_part_text_param import PromptCacheBreakpoint

    from prefixserve.entrypoints.server import prompt_cache_fields as ours

    def literals(hint) -> set:
        """The strings of the Literal types inside a type (through Optional, Required)."""
        found = set()
        for arg in get_args(hint):
            found |= {arg} if isinstance(arg, str) else literals(arg)
        return found

    hints = get_type_hints(params.CompletionCreateParamsBase)
    assert {"prompt_cache_key", "prompt_cache_options", "prompt_cache_retention"} <= set(hints)
    assert literals(hints["prompt_cache_retention"]) == set(ours.RETENTIONS)
    options = get_type_hints(params.PromptCacheOptions)
    assert set(options) == set(ours.OPTIONS_KEYS)
    assert literals(options["mode"]) == set(ours.MODES)
    assert literals(options["ttl"]) == set(ours.OPTION_TTLS)
    mark = get_type_hints(PromptCacheBreakpoint)
    assert set(mark) == set(ours.BREAKPOINT_KEYS)
    assert literals(mark["ttl"]) == set(ours.BREAKPOINT_TTLS)
    assert literals(mark["mode"]) == {"explicit"}
