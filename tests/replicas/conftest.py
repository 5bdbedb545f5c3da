"""One local Ray cluster per test module that asks for it (the Ray service tests), shut down after."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cluster():
    import ray   # the `replicas` extra, which the `test` extra includes
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="prefixserve-test")
    yield
    from ray import serve
    serve.shutdown()
    ray.shutdown()
