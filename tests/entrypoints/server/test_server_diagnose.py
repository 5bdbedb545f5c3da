"""Live cache-miss diagnosis from the server: a real uvicorn on a loopback port, the official
`openai` client (extra_body) and raw httpx.

Oracles: the prompts' token ids rendered here with the engine's tokenizer and a brute-force
longest common prefix; the rendered length of the system turn alone (which part a position
falls in); block-granular reuse (cached tokens = whole blocks of the common prefix); and the
rule that a salted request never sees another salt's text.
"""
from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest

from live_server import ENGINE, MODEL

from prefixserve.tokenizer import load_tokenizer

BS = ENGINE["block_size"]
POLICY = ("Answer briefly, cite the manual and never invent commands. The manual covers "
          "installation, configuration, the block manager, prefix caching, eviction and the "
          "HTTP server. ") * 3
DIAGNOSE = {"prefixserve": {"diagnose": True}}
FIELDS = {"cached_tokens", "prompt_tokens", "compared_to", "shared_tokens", "divergence_position",
          "part", "current_text", "earlier_text", "note"}


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


def system(head: str) -> str:
    """A long system prompt no other test shares (a fresh nonce first)."""
    return f"[{uuid.uuid4().hex[:8]}] {head} {POLICY}"


def conversation(system_text: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system_text}, {"role": "user", "content": user}]


def ids_of(tokenizer, messages: list[dict], generation: bool = True) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True)


def brute_lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def chat(oai, messages: list[dict], extra: dict | None = None, **kwargs):
    return oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                       temperature=0.0, extra_body=extra, **kwargs)


def diagnosis_of(response) -> dict:
    d = response.model_extra["prefixserve"]["diagnosis"]
    assert set(d) == FIELDS
    return d


def test_new_user_turn_diverges_after_the_shared_system_prompt(oai, tokenizer):
    sys_text = system("You are the prefixserve assistant.")
    first_msgs = conversation(sys_text, "How does eviction work?")
    second_msgs = conversation(sys_text, "Which block size should I use?")
    first = chat(oai, first_msgs)
    second = chat(oai, second_msgs, DIAGNOSE)
    a, b = ids_of(tokenizer, first_msgs), ids_of(tokenizer, second_msgs)
    lcp = brute_lcp(a, b)
    system_len = len(ids_of(tokenizer, first_msgs[:1], generation=False))
    assert system_len <= lcp < len(b)   # the oracle agrees the difference is in the user turn

    d = diagnosis_of(second)
    assert d["compared_to"] == first.id
    assert d["divergence_position"] == lcp == d["shared_tokens"]
    assert d["prompt_tokens"] == len(b) == second.usage.prompt_tokens
    assert d["cached_tokens"] == second.usage.prompt_tokens_details.cached_tokens
    assert d["cached_tokens"] == lcp // BS * BS > 0
    assert d["part"] == "new user turn (message 1)"
    assert d["note"] is None
    assert d["current_text"] and d["current_text"] in tokenizer.decode(b[lcp:], False)
    assert d["earlier_text"] and d["earlier_text"] in tokenizer.decode(a[lcp:], False)
    assert "prefixserve" not in (first.model_extra or {})   # not asked: nothing reported


def test_timestamp_in_the_system_prompt_is_named_with_its_text(oai, tokenizer):
    nonce = uuid.uuid4().hex[:8]
    earlier = conversation(f"[{nonce}] Current time: 2025-06-03 14:22:07 UTC. {POLICY}", "Hi")
    later = conversation(f"[{nonce}] Current time: 2025-06-03 14:23:41 UTC. {POLICY}", "Hi")
    first = chat(oai, earlier)
    d = diagnosis_of(chat(oai, later, {"diagnose": True}))
    a, b = ids_of(tokenizer, earlier), ids_of(tokenizer, later)
    lcp = brute_lcp(a, b)
    assert lcp < len(ids_of(tokenizer, later[:1], generation=False))
    assert (d["compared_to"], d["divergence_position"], d["part"]) == (first.id, lcp, "system prompt")
    assert "41 UTC" in d["current_text"] and "07 UTC" in d["earlier_text"]
    assert d["cached_tokens"] == lcp // BS * BS


def test_diagnose_against_a_named_request(oai, http, tokenizer):
    sys_text = system("You answer questions about caches.")
    msgs = {k: conversation(sys_text, user) for k, user in
            [("e", "Tell me about alpha."), ("f", "Explain pinning with beta gamma now."),
             ("g", "Explain pinning with beta delta now.")]}
    e, f = chat(oai, msgs["e"]), chat(oai, msgs["f"])
    ids = {k: ids_of(tokenizer, m) for k, m in msgs.items()}
    lcp_e, lcp_f = brute_lcp(ids["e"], ids["g"]), brute_lcp(ids["f"], ids["g"])
    assert lcp_e < lcp_f   # left alone, g would be compared with f

    closest = diagnosis_of(chat(oai, msgs["g"], DIAGNOSE))
    assert (closest["compared_to"], closest["divergence_position"]) == (f.id, lcp_f)
    named = diagnosis_of(chat(oai, msgs["g"], {"diagnose_against": e.id}))
    assert (named["compared_to"], named["divergence_position"]) == (e.id, lcp_e)
    nested = diagnosis_of(chat(oai, msgs["g"], {"prefixserve": {"diagnose_against": e.id}}))
    assert (nested["compared_to"], nested["divergence_position"]) == (e.id, lcp_e)

    # The Anthropic endpoint names the same earlier request, and is itself nameable.
    body = {"model": MODEL, "max_tokens": 3, "system": sys_text, "diagnose_against": e.id,
            "messages": [{"role": "user", "content": "Explain pinning with beta delta now."}]}
    message = http.post("/v1/messages", json=body).json()
    d = message["prefixserve"]["diagnosis"]
    assert (d["compared_to"], d["divergence_position"], d["part"]) == (
        e.id, lcp_e, "new user turn (message 1)")
    again = diagnosis_of(chat(oai, msgs["e"], {"diagnose_against": message["id"]}))
    assert (again["compared_to"], again["divergence_position"]) == (message["id"], lcp_e)


def test_unknown_id_gives_a_note(oai, tokenizer):
    msgs = conversation(system("Unknown ids."), "Hello?")
    response = chat(oai, msgs, {"diagnose_against": "chatcmpl-does-not-exist"})
    d = diagnosis_of(response)
    assert d["compared_to"] is None and d["divergence_position"] is None and d["part"] is None
    assert "chatcmpl-does-not-exist" in d["note"] and "not remembered" in d["note"]
    assert d["prompt_tokens"] == len(ids_of(tokenizer, msgs))


def test_salted_requests_never_compare_across_salts(oai, http):
    shared = system("Tenant support desk.")
    secret = conversation(shared + " Internal code: SECRET-PLUM-42.", "Status?")
    tenant_a = chat(oai, secret, {"cache_salt": "tenant-a"})
    # Same first tokens as tenant a's prompt, so without isolation a's text would be the
    # closest earlier prompt and show in earlier_text.
    public = conversation(shared + " Public notice: all good.", "Status?")
    first_b = chat(oai, public, {"cache_salt": "tenant-b", **DIAGNOSE})
    d = diagnosis_of(first_b)
    assert d["compared_to"] is None and "cache salt" in d["note"] and d["cached_tokens"] == 0
    named = chat(oai, public, {"cache_salt": "tenant-b", "diagnose_against": tenant_a.id})
    assert diagnosis_of(named)["compared_to"] is None and "not remembered under this cache salt" in \
        diagnosis_of(named)["note"]
    unsalted = chat(oai, public, DIAGNOSE)
    assert diagnosis_of(unsalted)["compared_to"] != tenant_a.id
    via_messages = http.post("/v1/messages", json={
        "model": MODEL, "max_tokens": 3, "system": public[0]["content"], "diagnose": True,
        "cache_salt": "tenant-b", "messages": [{"role": "user", "content": "Other question"}]})
    for response in (first_b.model_dump_json(), named.model_dump_json(),
                     unsalted.model_dump_json(), via_messages.text):
        assert "SECRET" not in response
    # Within its own salt a request is compared as usual.
    assert via_messages.json()["prefixserve"]["diagnosis"]["compared_to"] in (first_b.id, named.id)
    second_a = diagnosis_of(chat(oai, secret, {"cache_salt": "tenant-a", **DIAGNOSE}))
    assert second_a["compared_to"] == tenant_a.id and second_a["divergence_position"] is None


def test_nothing_unless_asked(oai, http):
    msgs = conversation(system("Quiet."), "Hi")
    assert "prefixserve" not in (chat(oai, msgs).model_extra or {})
    plain = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi there", "max_tokens": 2})
    assert "prefixserve" not in plain.json()
    with http.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": msgs, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert "prefixserve" not in r.read().decode()


def sse_data(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_streams_carry_the_diagnosis_in_their_final_chunk(oai, http):
    sys_text = system("Streaming.")
    chat(oai, conversation(sys_text, "One"))
    for usage, user in ((True, "Two"), (False, "Three")):
        body = {"model": MODEL, "messages": conversation(sys_text, user), "max_tokens": 3,
                "stream": True, "diagnose": True, "stream_options": {"include_usage": usage}}
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            chunks = sse_data(r.read().decode())
        carrying = [i for i, c in enumerate(chunks) if "prefixserve" in c]
        assert carrying == [len(chunks) - 1]
        final = chunks[-1]
        assert (final["usage"] is not None) == usage
        if not usage:
            assert final["choices"] and final["choices"][0]["finish_reason"] is not None
        d = final["prefixserve"]["diagnosis"]
        assert d["part"] == "new user turn (message 1)" and d["cached_tokens"] > 0

    anthropic_body = {"model": MODEL, "max_tokens": 3, "system": sys_text, "stream": True,
                      "prefixserve": {"diagnose": True},
                      "messages": [{"role": "user", "content": "Four"}]}
    with http.stream("POST", "/v1/messages", json=anthropic_body) as r:
        text = r.read().decode()
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    (delta,) = [e for e in events if e["type"] == "message_delta"]
    assert delta["prefixserve"]["diagnosis"]["part"] == "new user turn (message 1)"
    assert delta["prefixserve"]["diagnosis"]["cached_tokens"] == \
        delta["usage"]["cache_read_input_tokens"] > 0
    assert sum("diagnosis" in json.dumps(e) for e in events) == 1


def test_completions_compare_token_prompts(http):
    base = list(range(1000, 1000 + 3 * BS))
    first = http.post("/v1/completions", json={"model": MODEL, "prompt": base + [7, 8, 9],
                                               "max_tokens": 2}).json()
    second = http.post("/v1/completions", json={
        "model": MODEL, "prompt": base[:40] + [5, 6, 7], "max_tokens": 2,
        "diagnose_against": first["id"]}).json()
    d = second["prefixserve"]["diagnosis"]
    assert (d["compared_to"], d["divergence_position"], d["part"]) == (first["id"], 40, None)
    assert d["cached_tokens"] == 40 // BS * BS == second["usage"]["prompt_tokens_details"]["cached_tokens"]
    batch = http.post("/v1/completions", json={
        "model": MODEL, "prompt": [base + [1], base + [2]], "max_tokens": 2, "diagnose": True,
        "stream": True, "stream_options": {"include_usage": True}})
    final = sse_data(batch.text)[-1]
    first_d, second_d = final["prefixserve"]["diagnosis"]
    assert first_d["divergence_position"] == second_d["divergence_position"] == len(base)
    assert second_d["compared_to"] == first_d["request_id"] == final["id"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
@pytest.mark.parametrize("extra, param", [
    ({"diagnose": "yes"}, "diagnose"),
    ({"diagnose_against": 5}, "diagnose_against"),
    ({"prefixserve": {"diagnos": True}}, "prefixserve.diagnos"),
    ({"diagnose_against": ""}, "diagnose_against"),
    ({"diagnose_against": "a", "prefixserve": {"diagnose_against": "b"}}, "diagnose_against"),
])
def test_bad_diagnosis_fields_are_400(http, path, extra, param):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}], **extra}
    r = http.post(path, json=body)
    assert r.status_code == 400
    if path == "/v1/messages":
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert param.split(".")[-1] in r.json()["error"]["message"]
    else:
        assert r.json()["error"]["param"] == param
