"""Memory options of the command line: a byte count (`4GiB`, `512MiB`, `12345`) or a share of
the memory the device has free when the command starts (`0.5`, `50%`), as vLLM's
--gpu-memory-utilization is a share.

A share is kept as a DeviceShare until the engine's device is known (--device may come after
the option), then turned into bytes once, so the engine itself only ever sees bytes.
"""
from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass

from prefixserve.engine.config import parse_size

_SHARE = re.compile(r"\s*(?:(?P<fraction>0?\.[0-9]+|1\.0*)|(?P<percent>[0-9]+(?:\.[0-9]+)?)\s*%)\s*")

SHARE_HELP = ("or a share of the memory free on the device at start: 0.5 or 50%% (host memory on a CPU, "
              "torch.cuda.mem_get_info on CUDA)")


@dataclass(frozen=True)
class DeviceShare:
    fraction: float   # in (0, 1]

    def __str__(self) -> str:
        return f"{self.fraction:.0%} of free device memory"


def memory_size(text: str) -> int | DeviceShare:
    """An argparse type: bytes (with a unit or without), or a DeviceShare."""
    m = _SHARE.fullmatch(text)
    if m is None:
        if re.fullmatch(r"\s*[0-9]*\.[0-9]+\s*", text):
            # 1.5 would otherwise read as one byte: a plain decimal number is only ever a share
            raise argparse.ArgumentTypeError(f"a share of device memory is at most 1 (or 100%), got {text!r}")
        try:
            return parse_size(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{exc}, or a share of device memory (0.5, 50%)") from None
    fraction = float(m["fraction"]) if m["fraction"] is not None else float(m["percent"]) / 100
    if not 0 < fraction <= 1:
        raise argparse.ArgumentTypeError(f"a share of device memory must be above 0 and at most 100%, got {text!r}")
    return DeviceShare(fraction)


def free_device_memory(device: str) -> int:
    """Bytes free on `device` now: MemAvailable of the host for a CPU, the CUDA driver's free
    memory for a GPU."""
    kind = device.split(":")[0]
    if kind == "cpu":
        return _host_available()
    if kind == "cuda":
        import torch
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    raise ValueError(f"a share of device memory is not known on {device!r}; give the size in bytes (4GiB)")


def _host_available() -> int:
    """MemAvailable (free plus what the kernel can reclaim: the page cache), which is what a new
    allocation can take; where /proc is missing, the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def in_bytes(value: int | DeviceShare | None, device: str, option: str) -> int | None:
    """The option's value as bytes on `device` (a share resolved now)."""
    if not isinstance(value, DeviceShare):
        return value
    size = int(value.fraction * free_device_memory(device))
    if size < 1:
        raise ValueError(f"{option} {value} is 0 bytes on {device}")
    return size
