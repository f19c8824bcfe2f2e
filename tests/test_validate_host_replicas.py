"""experiment=validate_host's simulated side for replicas: N host-model boxes behind the
router, driven as one backend (the real side, processes behind research.serve.router, is a
benchmark, not a unit test)."""

from __future__ import annotations

from types import SimpleNamespace

from experiments.validate_host import SimulatedBackend
from research.bench.workload import random_requests
from research.config import CacheConfig, SchedulerConfig
from research.perf.cost_model import CostParams
from research.perf.host_model import HostCostModel, host_hardware, simulated_engine
from research.perf.simulated import ReplicaRouter


def _box() -> object:
    model = HostCostModel(
        "tiny-llama",
        None,
        host_hardware(5e9, 50e9),
        params=CostParams(1.0, 1e-3),
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
    )
    return simulated_engine(
        model,
        CacheConfig(block_size=16, num_kv_blocks=64),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        256,
    )


def test_two_host_model_replicas_serve_twice_one_at_saturation():
    """Eight concurrent requests: one box holds four at a time, two boxes all eight, so two
    replicas finish in about half the time (the router's clock, not the first box's)."""
    like = SimpleNamespace(model_id="tiny-llama", vocab_size=256, special_ids=())
    requests = random_requests(16, 32, 16, vocab_size=256, seed=1)
    one = SimulatedBackend(_box(), like, "one").run(requests, 8, False)
    two = SimulatedBackend(ReplicaRouter([_box(), _box()], seed=0, routing="least_loaded"), like,
                           "two").run(requests, 8, False)  # fmt: skip
    assert all(r.success for r in one.records + two.records)
    assert len(two.records) == len(requests)
    assert 0.4 < two.duration / one.duration < 0.75
