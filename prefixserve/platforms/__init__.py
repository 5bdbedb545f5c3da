"""What each kind of device needs: its kernels and the ops, weight layouts, KV layouts and dtype rules
built on them. Each platform module registers its platform (model/platform.py) when imported; model/
imports this package by name on its first lookup, so the dependency points from the platforms to the
model only. A new platform is one more line in PLATFORM_MODULES."""
import importlib

PLATFORM_MODULES = (
    "prefixserve.platforms.cpu.platform",
    "prefixserve.platforms.cuda.platform",
)

for _module in PLATFORM_MODULES:
    importlib.import_module(_module)
