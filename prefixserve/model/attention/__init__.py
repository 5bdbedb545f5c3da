"""Attention over the paged KV pool: per-step metadata and interchangeable backends."""
from prefixserve.model.attention.registry import import_backend_modules

# Each module registers the backends it defines (see registry.py); a new backend is one more line.
BACKEND_MODULES = (
    "prefixserve.model.attention.torch_paged",
)

import_backend_modules(BACKEND_MODULES)
