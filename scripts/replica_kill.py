"""The replica-kill experiment: 2 replicas, requests streaming on both, one replica killed
mid-run while new requests for its prefix keep arriving.

Prints what happened to the requests that were streaming on the killed replica and on the
other one, to the requests sent right after the kill (and how many the front retried), how
long until the router forgot the dead replica's blocks and until Ray Serve had 2 replicas
again. `python scripts/replica_kill.py`
"""
from __future__ import annotations

import asyncio
import time

import ray

from prefixserve.engine import EngineConfig
from prefixserve.errors import EngineError
from prefixserve.replicas.policy import RoutingConfig
from prefixserve.replicas.service import ReplicaConfig, ReplicaService
from prefixserve.sampling_params import SamplingParams


def main() -> int:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    service = ReplicaService(
        EngineConfig(model="random:qwen3-tiny", block_size=16, num_kv_blocks=512, dtype="float32"),
        ReplicaConfig(num_replicas=2, replica_cpus=1, app_name="kill", health_check_period_s=1.0,
                      routing=RoutingConfig()))
    front = service.start()
    try:
        asyncio.run(experiment(service, front))
    finally:
        service.stop()
        ray.shutdown()
    return 0


async def experiment(service, front) -> None:
    front.start()
    prompts = {t: front.tokenizer.encode(f"tenant {t} system prompt " + "lorem ipsum " * 150)
               for t in range(2)}
    long = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=4, temperature=0.0)
    # Warm both tenants so that each sits on one replica.
    owner = {}
    for t, tokens in prompts.items():
        s = await front.add_request(f"warm-{t}", {"prompt_token_ids": tokens}, short,
                                    cache_salt=f"t{t}")
        async for _ in s:
            pass
        owner[t] = s.replica
        await asyncio.sleep(0.3)
    streams = []
    for i in range(4):
        for t, tokens in prompts.items():
            s = await front.add_request(f"long-{t}-{i}", {"prompt_token_ids": tokens + [i]}, long,
                                        cache_salt=f"t{t}")
            await s.__anext__()
            streams.append(s)
    victim = owner[0]
    print(f"tenant 0 on {owner[0]}, tenant 1 on {owner[1]}; streams per replica: "
          f"{sum(s.replica == victim for s in streams)} on the victim, "
          f"{sum(s.replica != victim for s in streams)} on the other")

    async def finish(s):
        try:
            async for out in s:
                last = out
            return ("finished", last.outputs[0].finish_reason)
        except EngineError as exc:
            return ("error", str(exc))

    tasks = [asyncio.create_task(finish(s)) for s in streams]

    async def after_kill(done) -> float:
        while not await asyncio.to_thread(done):
            await asyncio.sleep(0.05)
        return time.monotonic() - t_kill

    def is_forgotten() -> bool:
        views = ray.get(service.hub.routing.remote())
        return all(not v["held"].get(victim) for v in views.values())

    def is_replaced() -> bool:
        stats = ray.get(service.hub.stats.remote())
        return len(stats) == 2 and victim not in stats

    t_kill = time.monotonic()
    forgot = asyncio.create_task(after_kill(is_forgotten))
    replaced = asyncio.create_task(after_kill(is_replaced))
    ray.kill(ray.get_actor(f"SERVE_REPLICA::kill#EngineReplica#{victim}", namespace="serve"),
             no_restart=True)
    retries_before = front.retries
    new = []
    for i in range(8):
        try:
            s = await front.add_request(f"after-{i}", {"prompt_token_ids": prompts[0] + [100 + i]},
                                        short, cache_salt="t0")
            async for out in s:
                last = out
            new.append(("ok", s.replica, last.num_cached_tokens))
        except Exception as exc:
            new.append(("failed", type(exc).__name__, str(exc)[:80]))
    done = await asyncio.gather(*tasks)
    for s, result in zip(streams, done):
        where = "victim" if s.replica == victim else "other"
        print(f"  streaming {s.request_id} on {where}: {result[0]} ({result[1][:70]})")
    print(f"requests sent after the kill: {[n[0] for n in new]}; replicas: "
          f"{sorted({n[1] for n in new if n[0] == 'ok'})}; cached tokens: "
          f"{[n[2] for n in new if n[0] == 'ok']}; front retries: {front.retries - retries_before}")
    print(f"router forgot the victim's blocks after {(await forgot):.2f} s; 2 replicas again (the "
          f"new one published its snapshot) after {(await replaced):.2f} s")


if __name__ == "__main__":
    raise SystemExit(main())
