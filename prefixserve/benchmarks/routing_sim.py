"""`python -m prefixserve.benchmarks.routing_sim`: a request log replayed over many replicas.

The log is the synthetic `tenants` one by default, or a logged one (`--log requests.jsonl`,
the format `prefixserve replay` reads, rendered through `--model`'s chat template and
tokenizer).

For each replica count: prefix-aware, round-robin and least-loaded routing over N pools of B
blocks, against one pool of N x B blocks; hit rate, its ratio to the single pool, and the
busiest replica's share of requests over the mean. Then prefix-aware and round-robin again
with a shared store (`shared store` rows): the share of prompt tokens loaded from it, and the
prompt tokens computed. Last, prefix-aware with every request carrying a prompt_cache_key (one
key per salt, as a client keys each tenant's or each agent's requests): routed by the key first
(`prompt_cache_key` row). No model runs: see replicas/simulator.py.
"""
from __future__ import annotations

import argparse
import dataclasses

from prefixserve.replicas.policy import ROUTERS, RoutingConfig
from prefixserve.replicas.simulator import SimRequest, simulate, tenant_requests


def load_log(path: str, model: str) -> list[SimRequest]:
    from prefixserve.diagnose.lint import to_replay
    from prefixserve.diagnose.log_reader import read_log
    from prefixserve.diagnose.render import load_renderer
    renderer = load_renderer(model)
    return [SimRequest(tuple(r.token_ids), r.cache_salt)
            for r in to_replay([renderer.render(rec) for rec in read_log(path)])]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--replicas", type=int, nargs="+", default=[8, 32])
    p.add_argument("--tenants-per-replica", type=int, default=6)
    p.add_argument("--requests-per-tenant", type=int, default=12)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--question-tokens", type=int, default=48)
    p.add_argument("--blocks-per-replica", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--concurrency-per-replica", type=int, default=4)
    p.add_argument("--balance-abs", type=int, default=RoutingConfig.balance_abs)
    p.add_argument("--balance-rel", type=float, default=RoutingConfig.balance_rel)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default=None, help="JSON Lines request log instead of the tenants one")
    p.add_argument("--model", default="random:qwen3-tiny", help="renders and tokenizes --log")
    a = p.parse_args(argv)
    logged = load_log(a.log, a.model) if a.log else None
    print("| replicas | salts | router | hit rate | / single pool | max/mean requests | "
          "loaded from store | computed prompt tokens | decisions |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in a.replicas:
        tenants = n * a.tenants_per_replica if logged is None else \
            len({r.cache_salt for r in logged})
        log = logged if logged is not None else tenant_requests(
            tenants, a.requests_per_tenant, a.system_tokens, a.question_tokens, seed=a.seed)
        conc = n * a.concurrency_per_replica
        single = simulate(log, num_replicas=1, blocks_per_replica=n * a.blocks_per_replica,
                          block_size=a.block_size, concurrency=conc)
        print(f"| 1 (x{n} pool) | {tenants} | - | {single.hit_rate:.3f} | 1.000 | 1.00 | - | "
              f"{single.computed_tokens} | - |")
        runs = [(r, False, "") for r in ROUTERS] + [("prefix-aware", True, ", shared store"),
                                                     ("round-robin", True, ", shared store"),
                                                     ("prefix-aware", False, ", prompt_cache_key")]
        keyed = [dataclasses.replace(r, routing_key=f"{r.cache_salt}|{r.cache_salt}") for r in log]
        for router, shared, suffix in runs:
            res = simulate(keyed if "key" in suffix else log, num_replicas=n, blocks_per_replica=a.blocks_per_replica,
                           block_size=a.block_size, concurrency=conc, shared_store=shared,
                           config=RoutingConfig(router=router, balance_abs=a.balance_abs,
                                                balance_rel=a.balance_rel))
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(res.reasons.items()))
            name = router + suffix
            from_store = f"{res.store_tokens / res.prompt_tokens:.3f}" if shared else "-"
            print(f"| {n} | {tenants} | {name} | {res.hit_rate:.3f} | "
                  f"{res.hit_rate / single.hit_rate:.3f} | {res.max_load_ratio:.2f} | "
                  f"{from_store} | {res.computed_tokens} | {reasons} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
