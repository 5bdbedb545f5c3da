"""Request logs written for the diagnose tests: one per rule, plus a clean one, and the helpers that build them."""
from __future__ import annotations

import json
import random
from pathlib import Path

STABLE = "\n".join(
    f"Rule {i}: answer questions about the Contoso help desk politely, cite the manual section "
    f"and never invent ticket numbers or product names." for i in range(1, 7))
WORDS = "printer login password invoice laptop screen network badge vpn email calendar".split()


def question(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(10)) + "?"


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"Call {name}.",
                                             "parameters": {"type": "object", "properties": {
                                                 "q": {"type": "string"}}}}}


TOOLS = [tool("lookup_ticket"), tool("search_manual"), tool("reset_password")]


def chat(messages: list[dict], tenant: str = "t", tools=None, **extra) -> dict:
    body = {"model": "m", "messages": messages}
    if tools:
        body["tools"] = tools
    return {"tenant": tenant, "body": body, **extra}


def sys(text: str) -> dict:
    return {"role": "system", "content": text}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def clean_log(seed: int = 0) -> list[dict]:
    """Stable system + tools first, history appended, new question last: nothing to report."""
    rng = random.Random(seed)
    out = []
    for _ in range(2):
        msgs = [sys(STABLE)]
        for _ in range(3):
            msgs.append(user(question(rng)))
            out.append(chat(list(msgs), tools=TOOLS))
            msgs.append(assistant(question(rng)))
    return out


def dynamic_system_log(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [chat([sys(f"Now: 2025-01-{day:02d} {rng.randint(10, 23)}:{rng.randint(10, 59)}. "
                      f"User {name}.\n{STABLE}"), user(question(rng))])
            for day, name in zip(range(3, 8), ["Alice", "Bob", "Carla", "Dmitri", "Emma"])]


def history_rewrite_log(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    u1, a1, u2, a2, u3 = (question(rng) for _ in range(5))
    return [chat([sys(STABLE), user(u1)]),
            chat([sys(STABLE), user(u1), assistant(a1), user(u2)]),
            chat([sys(STABLE), user("Summary of the conversation so far: printer trouble."),
                  user(u2), assistant(a2), user(u3)])]


def tool_order_log(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    reordered = [TOOLS[2], TOOLS[0], TOOLS[1]]
    rekeyed = [{k: t[k] for k in reversed(list(t))} for t in TOOLS]
    return [chat([sys(STABLE), user(question(rng))], tools=t) for t in (TOOLS, reordered, rekeyed)]


def whitespace_drift_log(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    variants = [STABLE, STABLE.replace("\n", "\r\n"), STABLE.replace(", ", ",  ", 2) + "\n",
                STABLE.replace("politely,", "politely, ", 1)]
    return [chat([sys(v), user(question(rng))]) for v in variants]


def short_prefix_log(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [chat([sys("Be brief."), user(f"{lead} {question(rng)}")])
            for lead in ("Why", "How", "When", "Where")]


def volatile_prefix_log(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [chat([sys("Snippets:\n" + "\n".join(question(rng) + " " + question(rng) for _ in range(2))
                      + "\n\n" + STABLE), user(question(rng))]) for _ in range(4)]


def call(name: str, arguments: str, call_id: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}


def result(call_id: str, text: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def reserialized_json_log(seed: int = 0) -> list[dict]:
    """The client sends the model's call and the tool's result back re-serialised each turn."""
    rng = random.Random(seed)
    u1, u2, u3 = (question(rng) for _ in range(3))
    rows = [{"ticket": 1000 + i, "status": rng.choice(WORDS), "score": 0.50 + i} for i in range(8)]
    as_sent = json.dumps({"rows": rows, "total": 8}).replace(".0,", ".00,")
    redumped = json.dumps({"total": 8, "rows": [dict(reversed(list(r.items()))) for r in rows]})
    first = [sys(STABLE), user(u1), call("lookup_ticket", '{"q": "printer", "limit": 1.50}', "c1"),
             result("c1", as_sent)]
    again = [sys(STABLE), user(u1), call("lookup_ticket", '{"limit": 1.5, "q": "printer"}', "c1"),
             result("c1", redumped)]
    return [chat(first + [user(u2)], tools=TOOLS),
            chat(again + [user(u2), assistant(question(rng)), user(u3)], tools=TOOLS)]


def history_truncation_log(seed: int = 0) -> list[dict]:
    """Each turn drops the middle of the conversation to stay short."""
    rng = random.Random(seed)
    u = [question(rng) + " " + question(rng) for _ in range(6)]
    a = [question(rng) + " " + question(rng) for _ in range(6)]
    return [chat([sys(STABLE), user(u[0]), assistant(a[0]), user(u[1]), assistant(a[1]), user(u[2]),
                  assistant(a[2]), user(u[3])]),
            chat([sys(STABLE), user(u[0]), assistant(a[0]), user(u[3]), assistant(a[3]), user(u[4])])]


def template_rewrite_log(seed: int = 0) -> list[dict]:
    """Append-only history, but the template drops earlier reasoning once a new user turn comes."""
    rng = random.Random(seed)
    thought = " ".join(question(rng) for _ in range(4))
    turns = [sys(STABLE), user(question(rng)),
             {**call("search_manual", '{"q": "vpn"}', "c1"), "reasoning_content": thought},
             result("c1", " ".join(question(rng) for _ in range(4)))]
    return [chat(turns, tools=TOOLS),
            chat(turns + [assistant(question(rng)), user(question(rng))], tools=TOOLS)]


def image(content_hash: str, width: int = 448, height: int = 336, tokens: int = 192, fmt: str = "PNG") -> dict:
    """An image part as `serve --request-log` records it (request_log.py)."""
    return {"type": "image", "prefixserve_image": {"hash": content_hash, "width": width, "height": height,
                                                   "tokens": tokens, "format": fmt, "bytes": 1000,
                                                   "sha256": content_hash * 2}}


def changed_image_log(seed: int = 0) -> list[dict]:
    """The same question about another picture each time (one of them the first one resized)."""
    rng = random.Random(seed)
    ask = question(rng)
    pictures = [image("%032x" % 1), image("%032x" % 2), image("%032x" % 3, 224, 168, 48)]
    return [chat([sys(STABLE), {"role": "user", "content": [picture, {"type": "text", "text": ask}]}])
            for picture in pictures]


# The model whose tokenizer a rule's log is linted with, where not random:qwen3-tiny's.
RULE_MODELS = {"changed-image": "random:qwen2.5-vl-tiny"}

RULE_LOGS = {"dynamic-system": dynamic_system_log, "history-rewrite": history_rewrite_log,
             "history-truncation": history_truncation_log, "reserialized-json": reserialized_json_log,
             "template-rewrite": template_rewrite_log,
             "tool-order": tool_order_log, "whitespace-drift": whitespace_drift_log,
             "short-prefix": short_prefix_log, "volatile-prefix": volatile_prefix_log,
             "changed-image": changed_image_log}


def write_log(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path
