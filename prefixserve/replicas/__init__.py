"""Engine replicas on Ray Serve behind exact prefix-aware routing (docs/replicas.md).

No Ray without it: policy, index and simulator are pure Python; Ray is imported by deployment
(the replica), router (Ray Serve's request router), front (the AsyncLLM-shaped client of the
replicas), service (start/stop) and metrics. The `serve --replicas` flags live in
entrypoints/serve_replicas.py; the benchmarks (benchmarks/routing_sim.py, replica_tenants.py)
drive this package from above.
hub holds the KV event hub's logic, run as a Ray actor by service.
"""
