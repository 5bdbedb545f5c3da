"""What lookups and allocations hand back to the scheduler."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefixHit:
    block_ids: list[int]            # physical blocks of the longest cached prefix, in order
    num_tokens: int                 # len(block_ids) * block_size
    # Generation of each hit block at lookup time: allocate_slots refuses a hit whose blocks
    # were evicted or reused in between.
    generations: list[int] = field(default_factory=list)
    # The query this hit answers; counted in the stats when allocate_slots takes the hit.
    query_tokens: int = 0
    preempted: bool = False


@dataclass
class Allocation:
    new_block_ids: list[int]        # fresh blocks appended to the request's table by this call
    # (src, dst) copy-on-write block copies the worker must do before the forward; dst has
    # replaced src in the request's table.
    copies: list[tuple[int, int]]
