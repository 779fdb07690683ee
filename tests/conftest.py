"""Shared test settings: hypothesis profiles and small synthetic traces."""
import os
import tempfile

os.environ.setdefault("KVSIM_THREADS", "1")
os.environ.setdefault("KVSIM_TABLES", tempfile.mkdtemp(prefix="kvsim-tables-"))   # not the user's cache
os.environ.setdefault("TRITON_INTERPRET", "1")   # Triton kernels on the CPU unless a GPU run sets 0, before any import

import pytest
from hypothesis import HealthCheck, settings

pytest_plugins = ["pytester"]

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=10, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", deadline=None, max_examples=2000, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for every test that runs work on Ray (skipped without Ray): kvsim reuses a running
    instance (``sim.experiments.executors.ray_map``), so the tests share its start-up (~4 s) and its idle workers
    instead of each starting and stopping its own. Shut down when the session ends."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
