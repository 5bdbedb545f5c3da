"""The vision tower's outputs by image content hash, under a byte budget, least recently used out first.

A second question about the same picture takes its embeddings from here; a prompt whose cached KV
prefix covers a picture never needs them at all (the runner asks only for images whose tokens it
computes).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

DEFAULT_ENCODER_CACHE_BYTES = 256 * 1024 * 1024


class EncoderCache:
    def __init__(self, max_bytes: int = DEFAULT_ENCODER_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"encoder cache bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.runs = 0       # images the vision tower encoded
        self.hits = 0       # images served from here

    def get_or_encode(self, content_hash: bytes, encode: Callable[[], torch.Tensor]) -> torch.Tensor:
        found = self._entries.get(content_hash)
        if found is not None:
            self._entries.move_to_end(content_hash)
            self.hits += 1
            return found
        out = encode()
        self.runs += 1
        size = out.numel() * out.element_size()
        if size <= self.max_bytes:
            while self.bytes + size > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.bytes -= dropped.numel() * dropped.element_size()
            self._entries[content_hash] = out
            self.bytes += size
        return out

    def __len__(self) -> int:
        return len(self._entries)
