"""Engine replicas on Ray Serve behind exact prefix-aware routing (docs/replicas.md).

No Ray without it: policy, index, simulator, sim_report and args are pure Python; Ray is
imported by deployment (the replica), router (Ray Serve's request router), front (the
AsyncLLM-shaped client of the replicas), service (start/stop), metrics and bench_tenants.
hub holds the KV event hub's logic, run as a Ray actor by service.
"""
