"""Request bodies the server must refuse with a 400 naming the field (or with no field, where the
body as a whole is at fault): values that used to fail inside the engine step or the tokenizer,
as raw JSON text. Written against a server with ServerConfig(max_messages=64,
max_body_bytes=2**20) on live_server.ENGINE: test_server_validation.py sends them in-process,
test_server_large_bodies.py through the render process as well."""
from __future__ import annotations

import httpx
from live_server import MODEL

CHAT = "/v1/chat/completions"


def raw_json(client: httpx.Client, path: str, text: str) -> httpx.Response:
    """JSON as the text given (NaN, Infinity and lone surrogate escapes are not what json.dumps sends)."""
    return client.post(path, content=text.encode(), headers={"content-type": "application/json"})


BAD_INPUTS = [
    # (path, JSON text, the field the 400 must name)
    (CHAT, '{"model": "%s", "max_tokens": 2, "top_k": %d, "messages": [{"role": "user", "content": "hi"}]}'
     % (MODEL, 2**63), "top_k"),
    (CHAT, '{"model": "%s", "max_tokens": 2, "top_k": %d, "messages": [{"role": "user", "content": "hi"}]}'
     % (MODEL, 10**29), "top_k"),
    (CHAT, '{"model": "%s", "max_tokens": 2, "cache_salt": "a\\ud800b", '
           '"messages": [{"role": "user", "content": "hi"}]}'
     % MODEL, "cache_salt"),
    (CHAT, '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "x\\udc00"}]}' % MODEL,
     "messages[0].content"),
    ("/v1/completions", '{"model": "%s", "max_tokens": 2, "prompt": "lone \\ud83d here"}' % MODEL, "prompt"),
    (CHAT, '{"model": "%s", "max_tokens": 2, "temperature": NaN, "messages": [{"role": "user", "content": "hi"}]}'
     % MODEL, "temperature"),
    (CHAT, '{"model": "%s", "max_tokens": 2, "top_p": Infinity, "messages": [{"role": "user", "content": "hi"}]}'
     % MODEL, "top_p"),
    (CHAT, '{"model": "%s", "max_tokens": 2, "messages": [{"role": "wizard", "content": "hi"}]}' % MODEL,
     "messages[0].role"),
    ("/v1/cached_contents", '{"system": "%s", "ttl": Infinity}' % ("x " * 60), "ttl"),
    ("/v1/cached_contents", '{"system": "%s", "ttl": %d}' % ("x " * 60, 10**400), "ttl"),
    ("/v1/cached_contents", '{"system": "%s", "ttl": "%sh"}' % ("x " * 60, "9" * 400), "ttl"),
    ("/v1/messages", '{"model": "%s", "max_tokens": 2, "top_k": %d, "messages": [{"role": "user", "content": "hi"}]}'
     % (MODEL, 2**40), "top_k"),
    (CHAT, '{"model": "%s", "max_tokens": 2, "chat_template": "{{ 1 }}", '
           '"messages": [{"role": "user", "content": "hi"}]}'
     % MODEL, "chat_template"),
    (CHAT, '{"model": "%s", "max_tokens": 2, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}, '
           '"messages": [{"role": "user", "content": "hi"}]}' % MODEL, "chat_template_kwargs.chat_template"),
    (CHAT, '{"model": "%s", "max_tokens": 2, "messages": [%s]}'
     % (MODEL, ", ".join(['{"role": "user", "content": "m"}'] * 65)), "messages"),
    (CHAT, '{"model": "%s", "max_tokens": 2, "tools": [%s1%s], "messages": [{"role": "user", "content": "hi"}]}'
     % (MODEL, "[" * 40, "]" * 40), None),
    (CHAT, '{"model": "%s", "max_tokens": 2, "stop": [%s], "messages": [{"role": "user", "content": "hi"}]}'
     % (MODEL, ", ".join(['"s%d"' % i for i in range(33)])), "stop"),
    ("/v1/cached_contents", '{"system": "%s", "name": "%s"}' % ("x " * 60, "n" * 300), "name"),
]
