"""One local Ray cluster for the whole test session: starting Ray costs seconds, so tests share it."""
import os

import pytest

# Keep JAX in the test process on the CPU and quiet; workers get their own settings from JaxConfig.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # 2 cores on CI: oversubscribe logical CPUs so 2 training workers and Ray Data tasks can all be placed.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}})
    yield ray
    ray.shutdown()
