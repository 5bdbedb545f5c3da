"""The device an engine runs on, checked once at start so a missing one fails with a clear message."""
from __future__ import annotations

import torch


def resolve_device(name: str | torch.device) -> torch.device:
    """torch.device(name), or a ValueError saying why this process cannot use it."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{name!r} is not a device torch understands: {exc}") from None
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)
    is_available = getattr(backend, "is_available", None)
    if is_available is None or not is_available():
        raise ValueError(f"device {str(device)!r} is not available: this torch build ({torch.__version__}) "
                         f"or this machine has no usable {device.type} device")
    count = getattr(backend, "device_count", None)
    if device.index is not None and count is not None and device.index >= count():
        raise ValueError(f"device {str(device)!r} is not available: this machine has {count()} "
                         f"{device.type} device(s)")
    return device
