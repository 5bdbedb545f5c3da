"""The diagnose tests' oracle of cache reuse: prompts served one at a time through prefixserve.kv
(the engine's own block hashing and lookup), never through the lint they check.

Shared by test_diagnose_textbook.py and test_diagnose_precedence.py."""
from __future__ import annotations

from prefixserve.kv import KVCacheConfig, KVCacheManager

SALT = "acme"
BLOCK = 16


class Engine:
    """Serves prompts one at a time through prefixserve.kv as the engine fills its cache (the
    prompt, then the generated reply and end-of-turn token), in a pool that never evicts."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.kv = KVCacheManager(KVCacheConfig(num_blocks=1 << 16, block_size=BLOCK))
        self.served = 0

    def tokens(self, messages: list[dict], tools: list[dict]) -> list[int]:
        text = self.tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                            add_generation_prompt=True)
        return self.tok.encode(text, add_special_tokens=False)

    def reuse(self, ids: list[int]) -> int:
        return self.kv.find_cached_prefix("lookup", ids, cache_salt=SALT).num_tokens

    def serve(self, ids: list[int], reply: str) -> int:
        rid = f"r{self.served}"
        self.served += 1
        out = self.tok.encode(reply, add_special_tokens=False) + [self.tok.eos_token_id]
        hit = self.kv.find_cached_prefix(rid, ids, cache_salt=SALT)
        self.kv.allocate_slots(rid, ids + out, hit.num_tokens, len(ids) - hit.num_tokens,
                               hit=hit, cache_salt=SALT)
        self.kv.allocate_slots(rid, ids + out, len(ids), len(out) - 1, cache_salt=SALT)
        self.kv.free(rid)
        return hit.num_tokens
