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


#: a run of at least this many tests (the whole suite, not a file) compiles the policies' kernels on a spare core
WARMUP_MIN_TESTS = 500


@pytest.fixture(scope="session", autouse=True)
def compile_policies_meanwhile(request):
    """On a cold numba cache (CI's clean clone), compiling the engine and the policies' kernels is ~400 s of one core
    of the suite; a helper process compiles them on the spare core meanwhile (``sim.replay.warmup``, niced), so that
    the tests that come to a policy later load it from the cache. Only for a whole-suite run on more than one core,
    and ``KVSIM_TEST_WARMUP=0`` turns it off; with a warm cache the helper is done in seconds."""
    from sim.replay.threads import available_cores

    if (len(request.session.items) < WARMUP_MIN_TESTS or available_cores() < 2
            or os.environ.get("KVSIM_TEST_WARMUP", "1") == "0"):
        yield
        return
    from policies import list_policies
    from sim.replay.warmup import compiling_meanwhile

    with compiling_meanwhile(list_policies(), processes=1):
        yield
