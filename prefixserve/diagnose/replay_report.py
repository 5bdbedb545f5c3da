"""Replay results as a table (text, JSON, Markdown) and a plot of hit rate against cache size."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from prefixserve.diagnose.replay import ReplayResult

_COLUMNS = ("block size", "eviction", "cache blocks", "cache tokens", "hit rate", "tokens saved",
            "prompt tokens", "output tokens", "evictions", "too large")


def _row(r: ReplayResult) -> list[str]:
    c = r.config
    return [str(c.block_size), c.eviction_policy, str(c.num_blocks), str(c.num_blocks * c.block_size),
            f"{100 * r.hit_rate:.1f}%", str(r.hit_tokens), str(r.prompt_tokens),
            str(r.output_tokens), str(r.evictions), str(len(r.too_large))]


def format_replay(results: Sequence[ReplayResult], fmt: str = "text") -> str:
    if fmt == "json":
        return json.dumps([{"block_size": r.config.block_size, "eviction": r.config.eviction_policy,
                            "cache_blocks": r.config.num_blocks, "hit_rate": r.hit_rate,
                            "tokens_saved": r.hit_tokens, "prompt_tokens": r.prompt_tokens,
                            "output_tokens": r.output_tokens, "evictions": r.evictions,
                            "too_large": r.too_large, "requests": r.num_requests}
                           for r in results], indent=2)
    rows = [_row(r) for r in results]
    if fmt == "markdown":
        lines = ["| " + " | ".join(_COLUMNS) + " |",
                 "|" + "|".join("---:" if i > 1 else "---" for i in range(len(_COLUMNS))) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines) + "\n"
    if fmt != "text":
        raise ValueError(f"format must be text, json or markdown, got {fmt!r}")
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(_COLUMNS)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(_COLUMNS, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines) + "\n"


def plot_replay(results: Sequence[ReplayResult], path: str | Path, title: str = "") -> Path:
    """Hit rate against cache size in tokens, one line per (block size, eviction policy)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"--plot must name a .png file, got {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    series: dict[tuple[int, str], list[ReplayResult]] = {}
    for r in results:
        series.setdefault((r.config.block_size, r.config.eviction_policy), []).append(r)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (block_size, policy), rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r.config.num_blocks)
        ax.plot([r.config.num_blocks * block_size for r in rs], [100 * r.hit_rate for r in rs],
                marker="o", label=f"block {block_size}, {policy}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cache size (tokens = blocks x block size)")
    ax.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
