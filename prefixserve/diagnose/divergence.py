"""Where a request stops sharing tokens with the closest earlier request.

ClosestPrefixIndex finds, among remembered requests with the same cache salt, the one sharing
the longest token-level common prefix with a new request. It indexes every request by a chain
of hashes over fixed 16-token chunks (the chunk size is internal, independent of the cache's
block size): the requests sharing the most whole chunks are the only candidates for the
longest common prefix, and their exact common prefix is then measured on the token ids
themselves, so a hash collision can never report a wrong position.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Sequence

from prefixserve.prompt import common_prefix_len

_CHUNK = 16


@dataclass
class _Entry:
    request_id: str
    token_ids: list[int]
    salt: Optional[str]
    keys: list[Hashable]
    payload: object
    owner: Optional[str] = None


class ClosestPrefixIndex:
    """Remembers requests (token ids + salt) and finds the one closest to a new request.

    max_entries bounds memory: beyond it the owner (tenant) holding the most requests forgets
    its least recently added or matched one, so one tenant's flood pushes out its own history,
    never another's (with one owner: the least recently used request; None keeps everything)."""

    def __init__(self, max_entries: Optional[int] = None) -> None:
        if max_entries is not None and (isinstance(max_entries, bool) or not isinstance(
                max_entries, int) or max_entries <= 0):
            raise ValueError(f"max_entries must be None or a positive int, got {max_entries!r}")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        # owner -> its request ids, least recently added or matched first
        self._by_owner: dict[Optional[str], OrderedDict[str, None]] = {}
        # chunk-chain key -> ids of the requests containing that chunk prefix, oldest first
        self._by_key: dict[Hashable, dict[str, None]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    @staticmethod
    def _chain(token_ids: Sequence[int], salt: Optional[str]) -> list[Hashable]:
        keys: list[Hashable] = [("root", salt)]
        parent = hash(keys[0])
        for start in range(0, len(token_ids) - _CHUNK + 1, _CHUNK):
            parent = hash((parent, tuple(token_ids[start:start + _CHUNK])))
            keys.append((len(keys), parent))
        return keys

    def add(self, request_id: str, token_ids: Sequence[int], salt: Optional[str] = None,
            payload: object = None, owner: Optional[str] = None) -> None:
        """Remember a request (replacing an earlier one with the same id), as owner's."""
        self.forget(request_id)
        keys = self._chain(token_ids, salt)
        self._entries[request_id] = _Entry(request_id, list(token_ids), salt, keys, payload, owner)
        self._by_owner.setdefault(owner, OrderedDict())[request_id] = None
        for key in keys:
            self._by_key.setdefault(key, {})[request_id] = None
        while self.max_entries is not None and len(self._entries) > self.max_entries:
            largest = max(self._by_owner.values(), key=len)
            self.forget(next(iter(largest)))

    def forget(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        mine = self._by_owner[entry.owner]
        del mine[request_id]
        if not mine:
            del self._by_owner[entry.owner]
        for key in entry.keys:
            ids = self._by_key.get(key)
            if ids is not None:
                ids.pop(request_id, None)
                if not ids:
                    del self._by_key[key]

    def get(self, request_id: str) -> Optional[_Entry]:
        return self._entries.get(request_id)

    def closest(self, token_ids: Sequence[int], salt: Optional[str] = None,
                exclude: Optional[str] = None) -> tuple[Optional[str], int]:
        """(id of the remembered request with the same salt sharing the longest common prefix
        with token_ids, that length); the most recent one on ties; (None, 0) when no request
        with this salt is remembered."""
        keys = self._chain(token_ids, salt)
        level = 0
        while level + 1 < len(keys) and keys[level + 1] in self._by_key:
            level += 1
        while level >= 0:
            best_id, best = None, -1
            for rid in self._by_key.get(keys[level], ()):
                if rid == exclude:
                    continue
                entry = self._entries[rid]
                if entry.salt != salt:
                    continue
                lcp = common_prefix_len(entry.token_ids, token_ids)
                if lcp >= best:
                    best_id, best = rid, lcp
            # A hash collision could put only false candidates at this level: then the true
            # closest request shares fewer chunks, so look one level down.
            if best_id is not None and best >= level * _CHUNK:
                self._entries.move_to_end(best_id)
                self._by_owner[self._entries[best_id].owner].move_to_end(best_id)
                return best_id, best
            level -= 1
        return None, 0


@dataclass
class Divergence:
    position: int                 # first token index where the two requests differ
    compared_to: Optional[str]    # the earlier request
    part: Optional[str]           # part of the current request holding that token
    earlier_part: Optional[str]   # part of the earlier request holding its token there
    context: str                  # text of the shared tokens just before the divergence
    current_text: str             # text from the divergence on, current request
    earlier_text: str             # same, earlier request

    def to_dict(self) -> dict:
        return {"position": self.position, "compared_to": self.compared_to, "part": self.part,
                "earlier_part": self.earlier_part, "context": self.context,
                "current_text": self.current_text, "earlier_text": self.earlier_text}


TEXT_WINDOW_TOKENS = 16
CONTEXT_TOKENS = 8


def describe_divergence(current: Sequence[int], earlier: Sequence[int], position: int,
                        decode: Callable[..., str],
                        current_part: Callable[[int], object],
                        earlier_part: Callable[[int], object],
                        compared_to: Optional[str]) -> Divergence:
    """The divergence at `position` with a few tokens of text on both sides."""
    def text(ids: Sequence[int]) -> str:
        return decode(list(ids), skip_special_tokens=False)

    def label(part: object) -> Optional[str]:
        return getattr(part, "label", part)

    return Divergence(
        position=position, compared_to=compared_to,
        part=label(current_part(position)) if position < len(current) else "end of request",
        earlier_part=label(earlier_part(position)),
        context=text(current[max(0, position - CONTEXT_TOKENS):position]),
        current_text=text(current[position:position + TEXT_WINDOW_TOKENS]),
        earlier_text=text(earlier[position:position + TEXT_WINDOW_TOKENS]))
