"""One local Ray cluster for the whole test session: starting Ray costs seconds, so tests share it (one per
pytest-xdist process, which is a session of its own)."""
import atexit
import compileall
import os
import shutil
import sys
import tempfile

import pytest

# With PYTHONDONTWRITEBYTECODE set (as on this project's CI machines), no import writes a .pyc, so every Ray worker
# compiled this package, and the test and example modules its loops live in, from source again: ~0.2 s of a CPU
# in each of the suite's hundreds of worker processes. Byte-compiled once here instead (up-to-date files are
# skipped); an import reads .pyc files whatever the variable says.
if sys.dont_write_bytecode:
    _ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for _part in ("ray_jax_train", "tests", "examples", "benchmarks"):
        compileall.compile_dir(os.path.join(_ROOT, _part), quiet=1)

# The test process itself runs single-process references on the CPU with 4 devices (for mesh tests).
# Set through jax.config, not XLA_FLAGS, so Ray workers (which inherit this environment) are unaffected.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One compilation cache for the session's runs (ray_jax_train reads JAX's own variable on the driver): most
# tests train the same tiny programs, and compiling them again in every test is most of the suite's time.
# Tests of the default (a cache in the run's storage) take this variable out with monkeypatch.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="rjt_test_compilation_cache_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)


# The longest modules first (serial seconds on 2 cores, measured): README's command runs the suite in 2 pytest-xdist
# processes, one module each at a time (--dist loadfile), and a long module started last leaves one core idle while
# it finishes (xdist's own order, by test count, put the benchmark smoke run and the 2-node cluster last).
LONGEST_FIRST = ("test_lm_loop", "test_tune", "test_checkpoint", "test_distributed_trainer", "test_core", "test_cli",
                 "test_benchmarks_smoke", "test_multinode", "test_core_errors", "test_s3_storage", "test_sharding",
                 "test_export", "test_generate", "test_text")


def pytest_collection_modifyitems(config, items):
    def weight(item):
        name = item.module.__name__.rsplit(".", 1)[-1] if item.module is not None else ""
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=weight)  # stable: each module's own order is kept


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # 2 cores on CI: oversubscribe logical CPUs so 2 training workers and Ray Data tasks can all be placed.
    # The 2 GPUs are logical only (no CUDA here): they let tests check which GPU ids Ray hands each worker.
    # Workers import the loops defined in tests/ and examples/ by module name.
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [here, os.path.join(os.path.dirname(here), "examples"), os.environ.get("PYTHONPATH", "")]
    if ray.is_initialized():  # a Ray-free test that started one anyway (a module run on its own meets it here)
        ray.shutdown()
    from ray_jax_train.trainer import with_import_guard

    ray.init(**with_import_guard(dict(
        num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=True,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}})))
    yield ray
    ray.shutdown()
