"""A digest of the weights actually loaded, for keys that must never outlive them.

Names and sizes of checkpoint files say what was meant to be loaded; only the tensors say
what was. KV stores scope their keys by this digest, so another checkpoint with the same
shapes (a fine-tune, a re-seeded random model, a corrupted download) reads none of the
blocks these weights computed. Hashing runs at memory speed (XXH3-128), once at start.
"""
from __future__ import annotations

import xxhash
import torch


@torch.inference_mode()
def weights_digest(model: torch.nn.Module) -> str:
    digest = xxhash.xxh3_128()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach()
        digest.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        if t.numel():
            flat = t.contiguous().cpu().reshape(-1)
            digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()
