"""What every benchmarked engine returns, and the interface the runner drives."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Protocol

from prefixserve.benchmarks.workloads import Workload

OnRequestDone = Callable[[], None]


@dataclass
class RequestRecord:
    request_id: str
    prompt_tokens: int
    cached_tokens: int            # prompt tokens served from a cache instead of computed
    output_token_ids: list[int]
    ttft_s: float                 # first token, from the arrival of the request's round
    e2e_s: float                  # last token, from the same arrival

    @property
    def tpot_s(self) -> Optional[float]:
        n = len(self.output_token_ids)
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else None


@dataclass
class RunResult:
    engine: str
    workload: str
    records: list[RequestRecord]
    wall_s: float
    computed_prompt_tokens: int   # prompt positions pushed through the model (padding included)
    peak_rss_bytes: int
    note: str = ""
    extra: dict = field(default_factory=dict)


class BenchEngine(Protocol):
    name: str

    def run(self, workload: Workload, on_done: OnRequestDone) -> RunResult: ...

    def close(self) -> None: ...


def tokenizer_vocab_size(folder: Path) -> int:
    """Ids the checkpoint's tokenizer can produce (max id + 1).

    prefixserve never samples an id past the tokenizer (random:qwen3-0.6b has
    151936 embedding rows but an 8192-token tokenizer); the baselines are held
    to the same range so every engine chooses among the same tokens.
    """
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    ids = list(data["model"]["vocab"].values()) + [t["id"] for t in data.get("added_tokens", [])]
    return max(ids) + 1
