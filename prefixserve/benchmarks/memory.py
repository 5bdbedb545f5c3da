"""Peak resident memory of a process (Linux: VmHWM; this process's peak window reset through clear_refs)."""
from __future__ import annotations

import resource
from pathlib import Path
from typing import Optional

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak_rss() -> bool:
    """Starts a new peak window; False where the OS cannot (the peak then covers the whole process)."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    peak = _vm_hwm(_STATUS)
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def process_peak_rss_bytes(pid: int) -> Optional[int]:
    """VmHWM of process `pid` (its whole life unless it reset its own window); None where /proc does not
    give it (not Linux, or the process is gone)."""
    return _vm_hwm(Path(f"/proc/{pid}/status"))


def _vm_hwm(status: Path) -> Optional[int]:
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
