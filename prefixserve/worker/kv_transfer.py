"""Moving whole blocks of K/V between the pool and host buffers, for the KV stores.

A block's payload is its K and V for every layer, as [layers, 2, *block] in the pool's dtype and
layout (model/kv_layout.py: a block of rows [block_size, kv_heads, head_dim], or of a platform's layout),
little-endian as the pool holds it: the layout named by `payload_layout`, which is part of every
stored block's key scope, so a pool of one layout never reads blocks stored from the other.

With a GPU pool the host side of every transfer is pinned memory and the copies run on a side stream
(`transfer_stream`): blocks going out are gathered and copied after the compute queued before them,
blocks coming in are copied into the pool while the host carries on, and the compute stream waits for
them before its next forward reads the pool. Every store (mem://, file://, redis://) reads and writes
through these same host buffers.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from prefixserve.model.config import ModelConfig
from prefixserve.model.kv_layout import ROWS, layout_named


def payload_layout(config: ModelConfig, block_size: int, layout: str = ROWS) -> str:
    return layout_named(layout).payload_name(config, block_size)


_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def transfer_stream(device: torch.device) -> "torch.cuda.Stream":
    """The side stream of a CUDA device's block transfers (one a device, made on first use)."""
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


@torch.inference_mode()
def read_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> np.ndarray:
    """A copy of the blocks' payloads as uint8 rows, one per block ([n, payload bytes])."""
    device = kv_caches[0].device
    if device.type == "cuda":
        return _read_blocks_cuda(kv_caches, block_ids, device)
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=device)
    data = _payloads(kv_caches, idx).cpu()
    return data.view(torch.uint8).reshape(len(block_ids), -1).numpy()


def _payloads(kv_caches: Sequence[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """[n, L, 2, *block] contiguous: the blocks `idx` of every layer."""
    # [L, 2, n, *block] -> [n, L, 2, *block]
    return torch.stack([cache.index_select(1, idx) for cache in kv_caches]).permute(2, 0, 1, 3, 4, 5).contiguous()


def _read_blocks_cuda(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], device: torch.device
                      ) -> np.ndarray:
    stream = transfer_stream(device)
    # after every write the compute stream has queued into these blocks
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        idx = torch.tensor(list(block_ids), dtype=torch.long).pin_memory().to(device, non_blocking=True)
        data = _payloads(kv_caches, idx)
        host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
        host.copy_(data, non_blocking=True)
    # the store takes the bytes now; only this stream is waited for, not the compute queued behind it
    stream.synchronize()
    return host.view(torch.uint8).reshape(len(block_ids), -1).numpy()


class LoadTargets:
    """Where blocks loaded from a store are read to: each block's payload as writable buffers in
    payload order (one per layer and K/V). On a CPU pool they are the pool's own memory, so a
    store reads straight into it; elsewhere they are a host buffer that `commit` copies into
    the pool."""

    def __init__(self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                 direct: bool | None = None) -> None:
        self.kv_caches = kv_caches
        self.block_ids = list(block_ids)
        if direct is None:
            direct = all(c.device.type == "cpu" and c.is_contiguous() for c in kv_caches)
        self.direct = direct
        if self.direct:
            self._staging = None
            # Slices of one byte view per layer: a tensor view per block and layer costs
            # more than the read it is for.
            num_blocks = kv_caches[0].shape[1]
            size = kv_caches[0][0, 0].numel() * kv_caches[0].element_size()
            layers = [_bytes_of(cache) for cache in kv_caches]
            self.buffers = [[layer[(kv * num_blocks + b) * size:(kv * num_blocks + b + 1) * size]
                             for layer in layers for kv in (0, 1)] for b in self.block_ids]
        else:
            # pinned where the pool is on a GPU: the copy into the pool then runs asynchronously
            self._staging = torch.empty((len(self.block_ids), len(kv_caches), 2, *kv_caches[0].shape[2:]),
                                        dtype=kv_caches[0].dtype,
                                        pin_memory=kv_caches[0].device.type == "cuda")
            row = self._staging[0, 0, 0].numel() * self._staging.element_size()
            flat = _bytes_of(self._staging)
            self.buffers = [[flat[(i * 2 * len(kv_caches) + r) * row:
                                  (i * 2 * len(kv_caches) + r + 1) * row]
                             for r in range(2 * len(kv_caches))] for i in range(len(self.block_ids))]

    @torch.inference_mode()
    def commit(self, count: int) -> None:
        """Makes the first `count` blocks' loaded payloads the pool's (a no-op when they were
        read into it directly)."""
        if self._staging is None or count == 0:
            return
        device = self.kv_caches[0].device
        if device.type != "cuda":
            self._copy_in(count, device)
            return
        stream = transfer_stream(device)
        compute = torch.cuda.current_stream(device)
        # the blocks may have been written by compute queued before (their previous contents)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            self._copy_in(count, device)
        # the next forward (on the compute stream) reads the pool only once the copies landed; the host
        # does not wait. The pinned staging stays alive until then: the allocator records the copy's use.
        compute.wait_stream(stream)

    def _copy_in(self, count: int, device: torch.device) -> None:
        assert self._staging is not None
        idx = torch.tensor(self.block_ids[:count], dtype=torch.long).to(device, non_blocking=True)
        data = self._staging[:count].to(device, non_blocking=True)
        for layer, cache in enumerate(self.kv_caches):
            cache.index_copy_(1, idx, data[:, layer].transpose(0, 1))


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's own memory."""
    if not t.is_contiguous():
        raise ValueError("a load target must be contiguous memory")
    return memoryview(t.view(-1).view(torch.uint8).numpy())
