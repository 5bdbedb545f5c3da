"""What the textbook logs of the lint tests are made of: a vocabulary of everyday engineering words,
the five tools of a coding agent, and conversation openers that share no token with each other.

Shared by tests/diagnose/test_diagnose_textbook.py (one mistake, and two) and
tests/diagnose/test_diagnose_pairs.py (every pair of mistakes).
"""
from __future__ import annotations

import random
import re

from prefixserve.diagnose import load_renderer

WORDS = ("request build cache token module server client test deploy branch merge config "
         "latency queue worker thread memory index schema table column query batch retry "
         "timeout error log metric trace span handler route endpoint payload header session "
         "user account invoice order refund shipment address policy document section clause "
         "summary report draft review comment note meeting agenda task deadline budget").split()


def tool(name: str, description: str, param: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {param: {"type": "string"}},
                       "required": [param]}}}


TOOLS = [tool("read_file", "Read a file of the repository.", "path"),
         tool("write_file", "Replace the content of a file.", "path"),
         tool("run_tests", "Run the test suite or one test file.", "target"),
         tool("search_code", "Search the repository for a regular expression.", "pattern"),
         tool("git_diff", "Show the diff of the working tree.", "path")]


def sentence(rng: random.Random, lo: int = 8, hi: int = 16) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    return words[0].capitalize() + " " + " ".join(words[1:]) + "."


def _openers() -> list[str]:
    """Capitalised words that are one token of their own even before a comma: a conversation
    opening with one shares no token of its first message with another conversation, so any
    earlier request is as good a comparison for a first turn as its predecessor in the log."""
    tok = load_renderer("random:qwen3-tiny").tokenizer
    found = []
    for i in range(tok.vocab_size):
        word = tok.id_to_token(i)
        if word and re.fullmatch(r"[A-Z][a-z]{3,}", word) and tok.encode(
                word + ", x", add_special_tokens=False)[0] == i:
            found.append(word)
    return found


OPENERS = _openers()
