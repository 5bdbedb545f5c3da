"""`serve --request-log`: requests sent through the official clients come back, read by the lint's
own reader, as the conversations that were sent; tenants are hashed, never named; the file is
0600 and rotation keeps it and PATH.1 under their bound.

Real server (uvicorn on a loopback port) with API keys; the oracle is what the test sent and the
ids the clients were answered with.
"""
from __future__ import annotations

import json
import os

import anthropic
import openai
import pytest
from live_server import ENGINE, MODEL, LiveServer
from waiting import wait_until

from prefixserve import EngineConfig, LLMEngine
from prefixserve.diagnose import load_renderer
from prefixserve.diagnose.log_reader import read_log
from prefixserve.entrypoints.cli import main
from prefixserve.entrypoints.server.app import build_app
from prefixserve.entrypoints.server.auth import KeyTable
from prefixserve.entrypoints.server.config import ServerConfig
from prefixserve.entrypoints.server.request_log import LoggedRequest, RequestLog

KEYS = {"key-of-north-0001": "northwind", "key-of-south-0002": "southwind"}
SYSTEM = "You answer questions about the help desk manual in one short sentence."


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reqlog")
    (folder / "keys.json").write_text(json.dumps(KEYS))
    path = folder / "requests.jsonl"
    app = build_app(LLMEngine(EngineConfig(**ENGINE)),
                    ServerConfig(keys=KeyTable.from_file(folder / "keys.json"), request_log=str(path)))
    with LiveServer(app) as live:
        yield live, path


def oai(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=120)


def lines_of(path, count: int) -> list[dict]:
    """The log's records once it holds `count` (the writer thread writes after the reply). Only
    whole lines: one read can land while the writer is part way through a record."""
    records: list[dict] = []

    def written() -> bool:
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        records[:] = [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]
        return len(records) >= count

    wait_until(written, what=f"{count} records in the request log")
    return records


def test_the_log_reads_back_as_the_conversations_sent(logged, tmp_path, capsys):
    server, path = logged
    north, south = oai(server, "key-of-north-0001"), oai(server, "key-of-south-0002")
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="key-of-north-0001", max_retries=0, timeout=120)
    before = len(lines_of(path, 0))
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the printer manual?"}]
    second = [*first, {"role": "assistant", "content": "Section 4."}, {"role": "user", "content": "And the VPN?"}]
    sent: dict[str, dict] = {}
    reply = north.chat.completions.create(model=MODEL, messages=first, max_tokens=4, temperature=0)
    sent[reply.id] = {"messages": first, "text": reply.choices[0].message.content, "tenant": "northwind"}
    stream = south.chat.completions.create(model=MODEL, messages=second, max_tokens=4, temperature=0, stream=True)
    chunks = list(stream)
    sent[chunks[0].id] = {"messages": second, "tenant": "southwind",
                          "text": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)}
    completion = north.completions.create(model=MODEL, prompt="The help desk opens at", max_tokens=4, temperature=0)
    sent[completion.id] = {"prompt": "The help desk opens at", "text": completion.choices[0].text,
                           "tenant": "northwind"}
    message = claude.messages.create(model=MODEL, max_tokens=4, system=SYSTEM,
                                     messages=[{"role": "user", "content": "Where is the printer manual?"}])
    sent[message.id] = {"messages": first, "text": message.content[0].text if message.content else "",
                        "tenant": "northwind"}

    raw = lines_of(path, before + len(sent))[before:]
    assert {r["request_id"] for r in raw} == set(sent)
    copy = tmp_path / "copy.jsonl"
    copy.write_text("".join(json.dumps(r) + "\n" for r in raw))
    renderer = load_renderer(MODEL)
    usage = {r["request_id"]: r["response"]["usage"] for r in raw}
    for record in read_log(copy):
        expected = sent[record.request_id]
        # The lint renders the logged body to the very prompt the engine was given.
        assert len(renderer.render(record).token_ids) == usage[record.request_id]["prompt_tokens"]
        if "messages" in expected:
            assert record.messages == expected["messages"]
        else:
            assert record.prompt == expected["prompt"]
        assert record.output_text == expected["text"] and record.model == MODEL
    assert main(["lint", str(copy), "--model", MODEL]) == 0
    assert "warning" not in capsys.readouterr().err

    # The tenant: one hash per tenant, neither its name nor its key anywhere in the file.
    tenant_of = {r["request_id"]: r["tenant"] for r in raw}
    hashes = {name: {tenant_of[rid] for rid, e in sent.items() if e["tenant"] == name}
              for name in ("northwind", "southwind")}
    assert all(len(h) == 1 for h in hashes.values()) and hashes["northwind"] != hashes["southwind"]
    text = path.read_text()
    for secret in [*KEYS, *KEYS.values()]:
        assert secret not in text
    assert os.stat(path).st_mode & 0o777 == 0o600


def entry(n: int, size: int) -> LoggedRequest:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": f"{n} " + "x" * size}]})
    return LoggedRequest(request_id=f"r{n}", timestamp=float(n), tenant="t", raw_body=body.encode(), chat=True,
                         choices=[("ok", "stop")], prompt_tokens=size, completion_tokens=1)


def test_rotation_keeps_both_files_under_the_bound(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text("")
    path.chmod(0o644)                       # an existing file is made private too
    bound = 4000
    log = RequestLog(path, max_bytes=bound)
    for n in range(60):
        log.add(entry(n, 150))
    log.add(entry(99, 2 * bound))          # alone larger than the bound: dropped, not written
    log.close()
    rotated = tmp_path / "log.jsonl.1"
    for file in (path, rotated):
        assert 0 < file.stat().st_size <= bound
        assert file.stat().st_mode & 0o777 == 0o600
    kept = [r.request_id for f in (rotated, path) for r in read_log(f)]
    # Whole records only, the newest last, nothing between PATH.1 and PATH lost.
    assert kept == [f"r{n}" for n in range(60 - len(kept), 60)]
