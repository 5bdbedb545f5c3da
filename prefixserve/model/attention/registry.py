"""Which attention backends exist, what each can run on, and which one a model gets.

A backend module registers its class with `@register_backend(name, devices=...,
dtypes=..., rank=...)`; the attention package imports every module named in its
`BACKEND_MODULES` list, so registration happens on first import of the package.
Adding a backend takes a new module holding the class and its registration, plus
its line in that list; a platform's backend (platforms/cuda's "triton") registers
when the platforms load, which `select_backend` asks for first. No model, runner
or engine code changes.

`select_backend(name, device, dtype)` returns a fresh instance of the named
backend, or for "auto" of the highest-ranked one that supports the device and
dtype. This module imports no backend: the dependency points from the backends
to the registry only.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from prefixserve.model.attention.backend import AttentionBackend
from prefixserve.model.platform import load_platforms

AUTO = "auto"


@dataclass(frozen=True)
class BackendSpec:
    name: str
    factory: Callable[..., AttentionBackend]   # called as factory(device=the model's device)
    devices: frozenset[str]        # device types, as torch.device(...).type spells them
    dtypes: frozenset[torch.dtype]
    rank: int                      # "auto" prefers the highest rank among the backends that fit
    # device types where "auto" may pick it (None: all of `devices`); others must ask for it by name
    auto_devices: frozenset[str] | None = None

    def unsupported(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this backend cannot serve `device` / `dtype`, or None if it can."""
        if device.type not in self.devices:
            return f"does not run on device type {device.type!r} (runs on: {', '.join(sorted(self.devices))})"
        if dtype not in self.dtypes:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.dtypes))
            return f"does not support dtype {str(dtype).removeprefix('torch.')} (supports: {names})"
        return None


# name -> spec; filled by the backend modules as they are imported.
BACKENDS: dict[str, BackendSpec] = {}
# module -> why it could not be imported (a GPU backend whose library is missing), for error messages.
FAILED_MODULES: dict[str, str] = {}


def register_backend(name: str, *, devices: Iterable[str], dtypes: Iterable[torch.dtype], rank: int = 0,
                     auto_devices: Iterable[str] | None = None):
    """Class decorator: makes an AttentionBackend selectable as `name`. The class is built as
    `cls(device=...)`, the model's device, so it can take that device's platform kernels.
    `auto_devices`: where "auto" may pick it (a backend that runs on the CPU only as a test of GPU kernels
    names just its GPU); by default every device it runs on."""
    if not name or name == AUTO:
        raise ValueError(f"a backend cannot be named {name!r}")

    def register(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
            raise TypeError(f"backend {name!r} must be an AttentionBackend subclass, got {cls!r}")
        if name in BACKENDS and BACKENDS[name].factory is not cls:
            raise ValueError(f"attention backend {name!r} is registered twice")
        cls.name = name
        BACKENDS[name] = BackendSpec(name, cls, frozenset(devices), frozenset(dtypes), rank,
                                     None if auto_devices is None else frozenset(auto_devices))
        return cls

    return register


def import_backend_modules(modules: Iterable[str]) -> None:
    """Imports each backend module so it registers; a module that cannot be imported is remembered, not fatal."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            FAILED_MODULES[module] = f"{type(exc).__name__}: {exc}"


def select_backend(name: str, device: torch.device | str, dtype: torch.dtype) -> AttentionBackend:
    """A new instance of backend `name` ("auto": the best-ranked one that fits device and dtype)."""
    device = torch.device(device)
    # a platform's backends register when the platforms load (model/platform.py)
    load_platforms()
    if name == AUTO:
        fitting = [spec for spec in BACKENDS.values() if spec.unsupported(device, dtype) is None
                   and (spec.auto_devices is None or device.type in spec.auto_devices)]
        if not fitting:
            raise ValueError(f"no attention backend supports device {str(device)!r} with dtype "
                             f"{str(dtype).removeprefix('torch.')}: {_listing(device, dtype)}")
        return max(fitting, key=lambda spec: spec.rank).factory(device=device)
    spec = BACKENDS.get(name)
    if spec is None:
        raise ValueError(f"attention backend {name!r} is not registered; registered: {_listing(device, dtype)}")
    reason = spec.unsupported(device, dtype)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} {reason}")
    return spec.factory(device=device)


def _listing(device: torch.device, dtype: torch.dtype) -> str:
    parts = []
    for spec in sorted(BACKENDS.values(), key=lambda s: -s.rank):
        reason = spec.unsupported(device, dtype)
        parts.append(spec.name if reason is None else f"{spec.name} ({reason})")
    parts += [f"{module} failed to import ({why})" for module, why in FAILED_MODULES.items()]
    return "; ".join(parts) or "none"
