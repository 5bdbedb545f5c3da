#!/usr/bin/env python3
"""Writes a realistic agent request log (JSONL, the format of prefixserve/diagnose/log_reader.py).

Several tenants share one server; each follows its own app's habits, and some of those habits
defeat prefix caching (the patterns `prefixserve lint` is built to find):

  acme      coding agent with tools, multi-turn with tool calls; its client rebuilds the tool list
            from a set (order and key order drift: tool-order) and, in long sessions, elides old
            tool outputs (history-rewrite).
  globex    support bot; the system prompt embeds the current time, a session UUID and the
            customer's name (dynamic-system).
  initech   retrieval assistant; retrieved passages are placed before the long stable
            instructions (volatile-prefix).
  umbrella  note-taking assistant whose prompt builder leaves stray spaces and CRLFs
            (whitespace-drift).
  hooli     tiny prompts, chat and completion endpoints: the shared prefix is shorter than a
            block (short-prefix).
  wayne     a clean multi-turn assistant with tools (the control group: no rule should fire).
  stark     data agent whose client rebuilds tool results and call arguments from parsed JSON on
            every turn (key order and separators drift: reserialized-json).
  cyberdyne long chats kept short by deleting the middle of the history (history-truncation).
  tyrell    reasoning assistant whose turns carry reasoning_content, which the template drops
            once a new user turn follows (template-rewrite).

Deterministic: the same --seed writes the same file.
Usage: python scripts/make_agent_log.py OUT.jsonl [--requests 200] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import random
import uuid
from dataclasses import dataclass, field
from typing import Callable

WORDS = ("request build cache token module server client test deploy branch merge config "
         "latency queue worker thread memory index schema table column query batch retry "
         "timeout error log metric trace span handler route endpoint payload header session "
         "user account invoice order refund shipment address policy document section clause "
         "summary report draft review comment note meeting agenda task deadline budget").split()
NAMES = ["Alice Chen", "Bob Okafor", "Carla Diaz", "Dmitri Ivanov", "Emma Larsen", "Farid Haddad",
         "Grace Kim", "Hiro Tanaka", "Ines Moreau", "Jon Berg"]


def sentence(rng: random.Random, lo: int = 6, hi: int = 16) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    return words[0].capitalize() + " " + " ".join(words[1:]) + "."


def paragraph(rng: random.Random, n: int) -> str:
    return " ".join(sentence(rng) for _ in range(n))


def stable_text(seed: str, n_paragraphs: int) -> str:
    """A long text that is the same for every request of an app (seeded by its name)."""
    rng = random.Random(seed)
    return "\n\n".join(paragraph(rng, 4) for _ in range(n_paragraphs))


def tool(name: str, description: str, params: dict[str, str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object",
                       "properties": {p: {"type": "string", "description": d}
                                      for p, d in params.items()},
                       "required": list(params)}}}


ACME_TOOLS = [
    tool("read_file", "Read a file of the repository.", {"path": "path relative to the root"}),
    tool("write_file", "Replace a file's content.", {"path": "file path", "content": "new text"}),
    tool("run_tests", "Run the test suite or one test file.", {"target": "test path or 'all'"}),
    tool("search_code", "Search the repository for a regex.", {"pattern": "regular expression"}),
    tool("git_diff", "Show the working tree diff.", {"path": "limit to this path"}),
]
WAYNE_TOOLS = [
    tool("get_weather", "Current weather for a city.", {"city": "city name"}),
    tool("get_calendar", "Events of a day.", {"date": "YYYY-MM-DD"}),
]


def reorder_keys(obj):
    """The same JSON value with keys in reverse order (what a different serialiser emits)."""
    if isinstance(obj, dict):
        return {k: reorder_keys(obj[k]) for k in reversed(list(obj))}
    if isinstance(obj, list):
        return [reorder_keys(v) for v in obj]
    return obj


@dataclass
class Conversation:
    tenant: str
    turns: int
    system: Callable[[int], str]             # turn index -> system prompt text
    tools: Callable[[int], list | None]
    history_hook: Callable[[list[dict], int], list[dict]] = lambda msgs, turn: msgs
    use_tools: bool = False
    reasoning: bool = False
    messages: list[dict] = field(default_factory=list)
    turn: int = 0


class LogWriter:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.clock = 1_750_000_000.0
        self.records: list[dict] = []

    def emit(self, tenant: str, body: dict, reply: str, tool_calls: list | None = None) -> None:
        self.clock += self.rng.uniform(0.2, 3.0)
        rid = f"req-{len(self.records):04d}"
        message = {"role": "assistant", "content": None if tool_calls else reply}
        if tool_calls:
            message["tool_calls"] = tool_calls
        self.records.append({
            "request_id": rid, "timestamp": round(self.clock, 3), "tenant": tenant, "body": body,
            "response": {"choices": [{"index": 0, "message": message,
                                      "finish_reason": "tool_calls" if tool_calls else "stop"}],
                         "usage": {"completion_tokens":
                                   max(1, len(json.dumps(tool_calls) if tool_calls else reply) // 4)}}})


def chat_step(writer: LogWriter, conv: Conversation) -> None:
    rng = writer.rng
    if conv.turn == 0:
        conv.messages = [{"role": "system", "content": conv.system(0)}]
    else:
        conv.messages[0] = {"role": "system", "content": conv.system(conv.turn)}
    question = f"{sentence(rng)} {sentence(rng)}"
    conv.messages.append({"role": "user", "content": question})
    sent = conv.history_hook([dict(m) for m in conv.messages], conv.turn)
    body = {"model": "qwen3", "messages": sent, "max_tokens": 256}
    tools = conv.tools(conv.turn)
    if tools:
        body["tools"] = tools
    reply = paragraph(rng, rng.randint(1, 3))
    if conv.use_tools and rng.random() < 0.7:
        name = rng.choice(["read_file", "search_code", "run_tests"])
        call_id = f"call_{rng.getrandbits(40):010x}"
        calls = [{"id": call_id, "type": "function", "function": {
            "name": name, "arguments": json.dumps({"path": f"src/{rng.choice(WORDS)}.py"})}}]
        writer.emit(conv.tenant, body, reply, calls)
        message = {"role": "assistant", "content": "", "tool_calls": calls}
        if conv.reasoning:
            message["reasoning_content"] = paragraph(rng, 2)
        conv.messages.append(message)
        conv.messages.append({"role": "tool", "tool_call_id": call_id,
                              "content": "\n".join(sentence(rng) for _ in range(rng.randint(3, 8)))})
        if conv.reasoning:
            # the agent loop goes on after the tool result, before the user speaks again
            sent = conv.history_hook([dict(m) for m in conv.messages], conv.turn)
            answer = paragraph(rng, rng.randint(1, 2))
            writer.emit(conv.tenant, {**body, "messages": sent}, answer)
            conv.messages.append({"role": "assistant", "content": answer})
    else:
        writer.emit(conv.tenant, body, reply)
        message = {"role": "assistant", "content": reply}
        if conv.reasoning:
            message["reasoning_content"] = paragraph(rng, 2)
        conv.messages.append(message)
    conv.turn += 1


def make_conversations(rng: random.Random, tenant: str) -> Conversation:
    if tenant == "acme":
        instructions = "You are Acme's coding agent.\n\n" + stable_text("acme", 6)
        base = ACME_TOOLS

        def acme_tools(turn: int) -> list:
            tools = [json.loads(json.dumps(t)) for t in base]
            roll = rng.random()
            if roll < 0.2:
                rng.shuffle(tools)
            elif roll < 0.3:
                tools = reorder_keys(tools)
            return tools

        def elide_old_outputs(msgs: list[dict], turn: int) -> list[dict]:
            if turn < 4:
                return msgs
            tool_msgs = [i for i, m in enumerate(msgs) if m["role"] == "tool"]
            for i in tool_msgs[:-2]:
                msgs[i] = {**msgs[i], "content": "[output elided to save context]"}
            return msgs

        return Conversation(tenant, rng.randint(4, 8), lambda turn: instructions, acme_tools,
                            elide_old_outputs, use_tools=True)
    if tenant == "globex":
        policy = stable_text("globex", 5)
        name = rng.choice(NAMES)
        session = str(uuid.UUID(int=rng.getrandbits(128)))

        def globex_system(turn: int) -> str:
            stamp = 1_750_000_000 + rng.randint(0, 86_400 * 30)
            hh, mm, ss = stamp // 3600 % 24, stamp // 60 % 60, stamp % 60
            day = 1 + stamp // 86_400 % 28
            return (f"You are Globex support. Current time: 2025-06-{day:02d} {hh:02d}:{mm:02d}:{ss:02d} UTC. "
                    f"Session {session}. You are talking to {name}.\n\n{policy}")

        return Conversation(tenant, rng.randint(2, 4), globex_system, lambda turn: None)
    if tenant == "initech":
        instructions = "Answer with citations like [1].\n\n" + stable_text("initech", 5)

        def initech_system(turn: int) -> str:
            passages = "\n".join(f"[{i + 1}] {sentence(rng, 12, 24)}" for i in range(3))
            return f"Retrieved passages:\n{passages}\n\n{instructions}"

        return Conversation(tenant, rng.randint(1, 2), initech_system, lambda turn: None)
    if tenant == "umbrella":
        notes = "You are Umbrella's note-taking assistant.\n\n" + stable_text("umbrella", 4)

        def umbrella_system(turn: int) -> str:
            # The builder pads a random sentence end and sometimes emits CRLF line ends.
            roll = rng.random()
            if roll < 0.2:
                return notes.replace("\n\n", "\r\n\r\n")
            if roll < 0.6:
                ends = [i for i in range(len(notes)) if notes.startswith(". ", i)]
                cut = rng.choice(ends) + 1
                return notes[:cut] + " " * rng.randint(1, 3) + notes[cut:]
            return notes

        return Conversation(tenant, rng.randint(1, 3), umbrella_system, lambda turn: None)
    if tenant == "hooli":
        return Conversation(tenant, 1, lambda turn: "Be brief.", lambda turn: None)
    if tenant == "wayne":
        assistant = "You are Wayne's personal assistant.\n\n" + stable_text("wayne", 4)
        return Conversation(tenant, rng.randint(2, 5), lambda turn: assistant,
                            lambda turn: WAYNE_TOOLS)
    if tenant == "stark":
        instructions = "You are Stark's data agent.\n\n" + stable_text("stark", 4)

        def redump(msgs: list[dict], turn: int) -> list[dict]:
            # the client keeps parsed objects and serialises them again, its own way each time
            for i, m in enumerate(msgs):
                if m["role"] == "tool":
                    value = {"lines": m["content"].split("\n"), "status": "ok", "turn": i}
                    msgs[i] = {**m, "content": json.dumps(reorder_keys(value) if rng.random() < 0.5
                                                          else value)}
                elif m.get("tool_calls"):
                    calls = [{**c, "function": {**c["function"], "arguments": json.dumps(
                        json.loads(c["function"]["arguments"]),
                        separators=(",", ":") if rng.random() < 0.5 else (", ", ": "))}}
                        for c in m["tool_calls"]]
                    msgs[i] = {**m, "tool_calls": calls}
            return msgs

        return Conversation(tenant, rng.randint(4, 7), lambda turn: instructions,
                            lambda turn: ACME_TOOLS, redump, use_tools=True)
    if tenant == "cyberdyne":
        instructions = "You are Cyberdyne's planning assistant.\n\n" + stable_text("cyberdyne", 4)

        def keep_ends(msgs: list[dict], turn: int) -> list[dict]:
            # the first exchange and the latest four messages; the middle goes
            return msgs if len(msgs) <= 7 else msgs[:3] + msgs[-4:]

        return Conversation(tenant, rng.randint(5, 8), lambda turn: instructions, lambda turn: None,
                            keep_ends)
    if tenant == "tyrell":
        instructions = "You are Tyrell's reasoning assistant.\n\n" + stable_text("tyrell", 4)
        return Conversation(tenant, rng.randint(3, 5), lambda turn: instructions,
                            lambda turn: WAYNE_TOOLS, use_tools=True, reasoning=True)
    raise ValueError(f"unknown tenant {tenant!r}")


TENANT_WEIGHTS = {"acme": 4, "globex": 3, "initech": 2, "umbrella": 3, "hooli": 3, "wayne": 2,
                  "stark": 2, "cyberdyne": 2, "tyrell": 2}


def make_log(num_requests: int, seed: int) -> list[dict]:
    if num_requests <= 0:
        raise ValueError(f"--requests must be > 0, got {num_requests}")
    rng = random.Random(seed)
    writer = LogWriter(rng)
    active: list[Conversation] = []
    tenants, weights = zip(*TENANT_WEIGHTS.items())
    while len(writer.records) < num_requests:
        if len(active) < 4 or rng.random() < 0.15:
            tenant = rng.choices(tenants, weights)[0]
            if tenant == "hooli" and rng.random() < 0.5:
                prompt = f"Q: {sentence(rng)}\nA:"
                writer.emit("hooli", {"model": "qwen3", "prompt": prompt, "max_tokens": 32},
                            sentence(rng))
                continue
            active.append(make_conversations(rng, tenant))
        conv = rng.choice(active)
        chat_step(writer, conv)
        if conv.turn >= conv.turns:
            active.remove(conv)
    return writer.records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="path of the JSONL log to write")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    records = make_log(args.requests, args.seed)
    with open(args.out, "w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")
    print(f"wrote {len(records)} requests to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
