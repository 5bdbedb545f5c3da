"""cache_control breakpoints become engine pins, and the pins' outcome goes back to the client:
the `prefixserve` extension object of a response and a warning header for refused pins."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from prefixserve.engine.outputs import CachePin, PinResult, RequestOutput
from prefixserve.prompt import TTL_SECONDS, Breakpoint

logger = logging.getLogger(__name__)
WARNING_HEADER = "prefixserve-cache-warning"


@dataclass(frozen=True)
class PinPlan:
    """The breakpoints of one request and the engine pins they became, in the same order."""
    breakpoints: list[Breakpoint]
    ttl_scale: float
    cached_content: Optional[str] = None
    tenant: Optional[str] = None   # whose share of the pinned blocks the pins count against

    @property
    def pins(self) -> list[CachePin]:
        # A breakpoint before the first token (nothing precedes it) pins nothing.
        return [CachePin(b.num_tokens, self._ttl_s(b), tenant=self.tenant, exact=b.exact)
                for b in self.breakpoints if b.num_tokens > 0]

    def _ttl_s(self, b: Breakpoint) -> float:
        return TTL_SECONDS[b.ttl] * self.ttl_scale

    def _paired(self, output: RequestOutput) -> list[tuple[Breakpoint, Optional[PinResult]]]:
        results = iter(output.pins)  # the engine reports pins in the order they were asked
        return [(b, next(results, None) if b.num_tokens > 0 else None) for b in self.breakpoints]

    def report(self, output: RequestOutput, to_unix: Callable[[float], float]) -> Optional[dict[str, Any]]:
        """The `prefixserve` extension object of a response (None when nothing to report)."""
        if not self.breakpoints and self.cached_content is None:
            return None
        entries = [{
            "where": b.where, "ttl": b.ttl, "ttl_seconds": self._ttl_s(b),
            "prefix_tokens": b.num_tokens,
            "pinned_tokens": result.pinned_tokens if result else 0,
            "expires_at": (to_unix(result.expires_at)
                           if result and result.expires_at is not None else None),
            "error": result.error if result else None,
        } for b, result in self._paired(output)]
        report: dict[str, Any] = {"cache_breakpoints": entries}
        if self.cached_content is not None:
            report["cached_content"] = self.cached_content
        return report

    def warnings(self, output: RequestOutput) -> list[str]:
        """One line per pin the engine refused (logged, and sent as a response header)."""
        lines = [f"{'prompt_cache_breakpoint' if b.exact else 'cache_control'} at {b.where} "
                 f"was not pinned: {result.error}"
                 for b, result in self._paired(output) if result is not None and result.error]
        for line in lines:
            logger.warning("request %s: %s", output.request_id, line)
        return lines


def warning_headers(lines: list[str]) -> dict[str, str]:
    if not lines:
        return {}
    # Header values must be one line of latin-1 text.
    value = "; ".join(lines).replace("\n", " ").encode("latin-1", "replace").decode("latin-1")
    return {WARNING_HEADER: value}


def unix_time(clock: Callable[[], float]) -> Callable[[float], float]:
    """Maps times of the engine's clock to Unix time, as of now."""
    def to_unix(t: float) -> float:
        return round(time.time() + (t - clock()), 3)
    return to_unix
