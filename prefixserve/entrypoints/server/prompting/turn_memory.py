"""Keeps an agent loop in the cache across turns: the next prompt reuses the very tokens the
model generated, not a re-tokenization of their text.

A chat template re-renders an earlier assistant turn as the same text, but tokenizing that text
again need not give the tokens the model sampled (a model may spell "Paris" as "Par" + "is";
under a grammar, a random model nearly always does), and from the first differing token on the
previous turn's output is a cache miss. So the server remembers, per cache namespace, the token
ids of recent finished turns (prompt + output, up to the end-of-turn token the output ended on)
under a hash of their text; when a new prompt's text starts with a remembered turn's text right
before an end-of-turn token, those ids replace the prefix's re-tokenization. The end-of-turn
token itself stays the template's: a model may end on another stop token (`<|endoftext|>` where
the template writes `<|im_end|>`), and its K/V was never computed anyway. The text is unchanged (the stored ids
decode to exactly the hashed text), so only the tokenization, and with it the cache hit,
changes; the namespace in the key keeps tenants from ever seeing each other's entries, and a
full memory evicts from the tenant holding the most, so one tenant's flood cannot push out
another's turns.

Breakpoints (cache_control) after the replaced prefix move with it; a request with a breakpoint
inside the replaced output, or asking for a diagnosis (its spans are token-indexed), keeps its
own tokenization.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from prefixserve.engine.outputs import CompletionOutput, RequestOutput
from prefixserve.entrypoints.server.prompting.render_pool import RenderedChat

MAX_TURNS = 2048
MAX_TOKENS = 4_000_000  # ~16 MB of token ids


@dataclass
class TurnMemory:
    """Bounded in turns and tokens. When full, the tenant holding the most (turns, or tokens when
    those are over) gives up its least recently used turn: a tenant flooding the memory evicts
    its own turns, never the last ones of a tenant that holds fewer."""
    max_turns: int = MAX_TURNS
    max_tokens: int = MAX_TOKENS
    _turns: dict = field(default_factory=dict)   # (namespace, digest) -> (array of ids, tenant)
    _lru: dict = field(default_factory=dict)     # tenant -> OrderedDict of its keys, oldest first
    _tokens_of: dict = field(default_factory=dict)
    _tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_turns < 0 or self.max_tokens < 0:
            raise ValueError("max_turns and max_tokens must be >= 0")

    def remember(self, namespace: Optional[str], prompt_text: str, prompt_ids: Sequence[int],
                 output: RequestOutput, tokenizer, tenant: Optional[str] = None) -> None:
        """Records each sample that ended on an end-of-turn token, as tenant's."""
        for c in output.outputs:
            turn = turn_of(prompt_text, prompt_ids, c, tokenizer)
            if turn is not None:
                self.restore(namespace, *turn, tenant)

    def restore(self, namespace: Optional[str], text: str, ids: Sequence[int],
                tenant: Optional[str] = None) -> None:
        """Records one finished turn: its text and the token ids it was generated as (a stored
        response's turn, kept elsewhere across restarts, comes back through here)."""
        ids = array("i", ids)   # 4 bytes an id (vocabularies are far below 2**31)
        if len(ids) > self.max_tokens:
            return
        key = (namespace, _digest(text))
        self._drop(key)
        self._turns[key] = (ids, tenant)
        self._lru.setdefault(tenant, OrderedDict())[key] = None
        self._tokens_of[tenant] = self._tokens_of.get(tenant, 0) + len(ids)
        self._tokens += len(ids)
        while len(self._turns) > self.max_turns or self._tokens > self.max_tokens:
            if len(self._turns) > self.max_turns:
                victim = max(self._lru, key=lambda t: len(self._lru[t]))
            else:
                victim = max(self._tokens_of, key=self._tokens_of.__getitem__)
            self._drop(next(iter(self._lru[victim])))

    def _drop(self, key: tuple) -> None:
        entry = self._turns.pop(key, None)
        if entry is None:
            return
        ids, tenant = entry
        lru = self._lru[tenant]
        del lru[key]
        self._tokens -= len(ids)
        self._tokens_of[tenant] -= len(ids)
        if not lru:
            del self._lru[tenant], self._tokens_of[tenant]

    def splice(self, namespace: Optional[str], rendered: RenderedChat, tokenizer) -> RenderedChat:
        """`rendered` with the longest remembered turn its text starts with in its own tokens."""
        if rendered.spans is not None:
            return rendered
        found = self.continue_from(namespace, rendered.text, rendered.token_ids,
                                   [b.num_tokens for b in rendered.breakpoints], tokenizer)
        if found is None:
            return rendered
        token_ids, counts = found
        return replace(rendered, token_ids=token_ids,
                       breakpoints=[replace(b, num_tokens=n) for b, n in zip(rendered.breakpoints, counts)])

    def continue_from(self, namespace: Optional[str], text: str, token_ids: list[int],
                      breakpoint_tokens: list[int], tokenizer) -> Optional[tuple[list[int], list[int]]]:
        """(token ids, breakpoint token counts) with the longest remembered turn this prompt
        starts with spliced in; None when nothing applies."""
        if not self._turns:
            return None
        hit = None
        hasher = hashlib.sha256()
        done = 0
        for index, start in _turn_ends(text, token_ids, tokenizer):
            hasher.update(text[done:start].encode("utf-8", "surrogatepass"))
            done = start
            key = (namespace, hasher.copy().hexdigest())
            entry = self._turns.get(key)
            if entry is not None:
                hit = (index, entry, key)
        if hit is None:
            return None
        k, (stored, tenant), key = hit
        self._lru[tenant].move_to_end(key)
        first_diff = next((i for i, (a, b) in enumerate(zip(stored, token_ids)) if a != b), min(len(stored), k))
        if first_diff >= k:
            return None  # already the same tokens
        shift = len(stored) - k
        moved = []
        for n in breakpoint_tokens:
            if first_diff < n < k:
                return None
            moved.append(n + shift if n >= k else n)
        return list(stored) + token_ids[k:], moved


def turn_of(prompt_text: str, prompt_ids: Sequence[int], completion: CompletionOutput,
            tokenizer) -> Optional[tuple[str, list[int]]]:
    """(text, token ids) of a finished turn, up to the end-of-turn token its sample ended on;
    None when it ended otherwise (nothing to continue exactly)."""
    ids = completion.token_ids
    if completion.finish_reason != "stop" or not ids or ids[-1] not in tokenizer.eos_token_ids:
        return None
    text = prompt_text + tokenizer.decode(ids[:-1], skip_special_tokens=False)
    return text, [*prompt_ids, *ids[:-1]]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _turn_ends(text: str, token_ids: list[int], tokenizer) -> list[tuple[int, int]]:
    """(token index, character start) of every end-of-turn token, matched in order between the
    token ids and the text; empty when they do not pair up (then nothing is spliced)."""
    ends = []
    for eos in tokenizer.eos_token_ids:
        marker = tokenizer.decode([eos], skip_special_tokens=False)
        if not marker:
            continue
        indices = [i for i, t in enumerate(token_ids) if t == eos]
        chars, at = [], text.find(marker)
        while at >= 0:
            chars.append(at)
            at = text.find(marker, at + len(marker))
        if len(indices) != len(chars):
            return []
        ends += zip(indices, chars)
    return sorted(ends)
