"""Bad input fails early with a message that names the problem and the fix (driver side, no workers)."""
import errno
import json
import logging
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from ray.train import ScalingConfig

import ray_jax_train as rjt
from ray_jax_train.backend import _usable_cores, assigned_gpus, multislice_env, plan_node_cores, resolve_jax_config
from ray_jax_train.data import check_batch_size


def _loop(config):
    pass


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_num_cpu_devices_must_be_positive(bad):
    with pytest.raises(ValueError, match="num_cpu_devices"):
        rjt.JaxConfig(num_cpu_devices=bad)


@pytest.mark.parametrize("bad,error,fragment", [
    ({"distributed": "false"}, TypeError, "distributed='false') must be True or False"),  # was read as True
    ({"initialization_timeout_s": -5}, ValueError, "must be a number of seconds > 0"),
    ({"env_vars": ["JAX_FOO=1"]}, TypeError, "must be a dict of name -> value, got a list"),
    ({"xla_flags": 5}, TypeError, "takes a list of XLA flags"),
    ({"gpu_memory_fraction": "0.5"}, TypeError, "must be a number in (0, 1]"),
])
def test_jax_config_settings_of_the_wrong_kind_are_refused(bad, error, fragment):
    """A Python API review: strings for booleans were kept (truthy), lists and strings failed deep inside."""
    with pytest.raises(error) as raised:
        rjt.JaxConfig(**bad)
    assert fragment in str(raised.value)


def test_an_ipv6_node_s_coordinator_address_is_bracketed():
    """gRPC read "fd00::1:1234" as a host without a port: initialize waited out its timeout and aborted."""
    from ray_jax_train.backend import coordinator_address

    assert coordinator_address("fd00::1", 1234) == "[fd00::1]:1234"
    assert coordinator_address("[fd00::1]", 1234) == "[fd00::1]:1234"
    assert coordinator_address("10.0.0.7", 1234) == "10.0.0.7:1234"


def test_cpu_affinity_puts_workers_on_distinct_physical_cores():
    """Topologies written out: this 2-core VM has no hyperthreads (test_core pins real workers on it)."""
    # 8 cores x 2 threads, Linux's usual numbering: cpu i and i + 8 are one core.
    smt = [(cpu, (0, cpu % 8)) for cpu in range(16)]
    assert plan_node_cores(smt, 2, 1) == [[0], [1]]
    assert plan_node_cores(smt, 2, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # The siblings adjacent (cpu 2k and 2k + 1 one core), as some VMs number them: 1 and 2, not 0 and 1.
    adjacent = [(cpu, (0, cpu // 2)) for cpu in range(16)]
    assert plan_node_cores(adjacent, 2, 1) == [[0], [2]]
    # More CPUs asked for than physical cores: whole cores per worker, no core split between two.
    assert plan_node_cores(smt, 3, 3) == [[0, 8, 1], [2, 10, 3], [4, 12, 5]]
    assert plan_node_cores(smt, 4, 4) == [[0, 8, 1, 9], [2, 10, 3, 11], [4, 12, 5, 13], [6, 14, 7, 15]]
    # Short even of whole cores (5 x 3 = 15 of 16 threads): workers share, none left unpinned.
    assert all(len(c) == 3 for c in plan_node_cores(smt, 5, 3))
    # Too few CPUs: the ranks past them are not pinned.
    assert plan_node_cores([(0, (0, 0)), (1, (0, 1))], 3, 1) == [[0], [1], None]
    # This machine's own topology reads, one entry per usable CPU.
    assert [cpu for cpu, _ in _usable_cores()] == sorted(os.sched_getaffinity(0))


def test_unknown_platform():
    with pytest.raises(ValueError, match="not a platform"):
        rjt.JaxConfig(platform="metal")


def test_gpu_shares_are_checked_and_capped_on_the_driver(caplog):
    """A GPU user's review: fractional GPUs for 2 workers of one job, or 1.5 GPUs, failed only in Ray or NCCL;
    a share of a GPU from the Python API got JAX's 75% preallocation (only the CLI capped it)."""
    def resolved(workers, gpus, **jax_config):
        config = rjt.JaxConfig(**jax_config) if jax_config else None
        return resolve_jax_config(config, ScalingConfig(num_workers=workers, use_gpu=True,
                                                        resources_per_worker={"GPU": gpus}))

    with pytest.raises(ValueError, match=r"0.5 of a GPU per worker with 2 workers.*NCCL.*whole GPU"):
        resolved(2, 0.5)
    with pytest.raises(ValueError, match=r"1.5 GPUs per worker.*whole number"):
        resolved(1, 1.5)
    assert resolved(2, 0.5, distributed=False).gpu_memory_fraction == pytest.approx(0.475)  # separate jobs share
    shared = resolved(1, 0.25).worker_env()
    assert shared["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert float(shared["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == pytest.approx(0.2375)
    assert resolved(1, 0.25, gpu_memory_fraction=0.2).gpu_memory_fraction == 0.2  # set by hand: kept
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in resolved(2, 2).worker_env()  # whole GPUs: JAX's defaults
    with pytest.raises(ValueError, match=r"does not fit the 4 devices"):
        resolved(2, 2, mesh={"dp": 8})
    with caplog.at_level("WARNING", logger="ray_jax_train.backend"):
        resolved(1, 1, num_cpu_devices=2, cpu_affinity=True)
    assert "JaxConfig(num_cpu_devices, cpu_affinity) applies to CPU workers only" in caplog.text


def test_gpu_platform_without_gpus_in_scaling_config():
    with pytest.raises(ValueError, match="use_gpu=True"):
        rjt.JaxTrainer(_loop, jax_config=rjt.JaxConfig(platform="gpu"), scaling_config=ScalingConfig(num_workers=2))


def test_platform_follows_scaling_config_and_env(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert resolve_jax_config(None, ScalingConfig(num_workers=1)).platform == "cpu"
    assert resolve_jax_config(None, ScalingConfig(num_workers=1, use_gpu=True)).platform == "gpu"
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    # Named as the user set it (a job's runtime_env, say), with the CLI's key: not a JaxConfig they never wrote.
    with pytest.raises(ValueError, match=r"JAX_PLATFORMS='cuda,cpu' \(set in this process's environment.*no GPU.*"
                                         r"--set scaling.use_gpu=true\), or JAX_PLATFORMS=cpu"):
        resolve_jax_config(None, ScalingConfig(num_workers=1))
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    with pytest.raises(ValueError, match=r"JAX_PLATFORMS='tpu' .* asks for TPU workers.*or JAX_PLATFORMS=cpu"):
        resolve_jax_config(None, ScalingConfig(num_workers=1))
    # An explicit platform wins over the environment.
    assert resolve_jax_config(rjt.JaxConfig(platform="cpu"), ScalingConfig(num_workers=1)).platform == "cpu"


def test_worker_env_carries_jax_and_xla_settings():
    config = rjt.JaxConfig(platform="cpu", xla_flags=["--xla_cpu_enable_fast_math=false"],
                           gpu_memory_preallocate=False, gpu_memory_fraction=0.25,
                           env_vars={"JAX_DEBUG_NANS": "1"}, compilation_cache_dir="/tmp/cc")
    env = config.worker_env()
    assert env["JAX_PLATFORMS"] == "cpu"
    assert "--xla_cpu_enable_fast_math=false" in env["XLA_FLAGS"]
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.2500"
    assert env["JAX_DEBUG_NANS"] == "1" and env["JAX_COMPILATION_CACHE_DIR"] == "/tmp/cc"
    # One string is a command line, not a list of characters (XLA aborted every worker on "- - x l a ...", and Ray
    # retried the group forever); values that are not strings are written as strings, not a TypeError in set-up.
    one = rjt.JaxConfig(xla_flags="--xla_cpu_enable_fast_math=false  --xla_cpu_use_thunk_runtime=true",
                        env_vars={"JAX_ENABLE_X64": True, "JAX_TRACEBACK_FILTERING_LIMIT": 3})
    assert one.xla_flags == ["--xla_cpu_enable_fast_math=false", "--xla_cpu_use_thunk_runtime=true"]
    assert one.worker_env()["XLA_FLAGS"].endswith("--xla_cpu_enable_fast_math=false --xla_cpu_use_thunk_runtime=true")
    assert one.worker_env()["JAX_ENABLE_X64"] == "true" and one.worker_env()["JAX_TRACEBACK_FILTERING_LIMIT"] == "3"
    # XLA_FLAGS in env_vars come after the worker's own (a runtime_env's), which they replaced: a device count set
    # there was dropped, though the driver had counted it, and the mesh failed in every worker (a backend review).
    both = rjt.JaxConfig(env_vars={"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}, xla_flags=["--xla_x=1"])
    own = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    assert both.worker_env(own)["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=4 "
                                                 "--xla_cpu_enable_fast_math=false --xla_x=1")
    assert both.worker_env({})["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false --xla_x=1"
    from ray_jax_train.backend import hand_set_cpu_devices

    assert hand_set_cpu_devices(both.worker_env(own)) == 4
    from ray.train import RunConfig

    from ray_jax_train.backend import _cpu_devices_per_worker, hand_set_cpu_devices

    # The driver's count per worker, for its mesh check: JaxConfig's number wins; else a count set by hand in the
    # config or the workers' runtime_env (Ray's way); else 1.
    by_flag = RunConfig(worker_runtime_env={"env_vars": {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}})
    assert _cpu_devices_per_worker(rjt.JaxConfig(), by_flag) == 4
    assert _cpu_devices_per_worker(rjt.JaxConfig(num_cpu_devices=1), by_flag) == 1
    assert _cpu_devices_per_worker(rjt.JaxConfig(env_vars={"JAX_NUM_CPU_DEVICES": 3})) == 3
    assert _cpu_devices_per_worker(rjt.JaxConfig()) == 1
    config = resolve_jax_config(rjt.JaxConfig(mesh={"dp": 2, "fsdp": 4}), ScalingConfig(num_workers=2), by_flag)
    assert config.mesh == {"dp": 2, "fsdp": 4}  # refused before: "does not fit the 2 devices"

    assert hand_set_cpu_devices({"XLA_FLAGS": "--a=1 --xla_force_host_platform_device_count=8"}) == 8
    assert hand_set_cpu_devices({"JAX_NUM_CPU_DEVICES": "3", "XLA_FLAGS": ""}) == 3
    assert hand_set_cpu_devices({"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}) is None
    with pytest.raises(ValueError, match=r"\['xla_cpu_enable_fast_math=false'\] are not flags"):
        rjt.JaxConfig(xla_flags=["xla_cpu_enable_fast_math=false"])
    with pytest.raises(ValueError, match="env_vars=.*'PATHS': \\['a'\\].*got a list"):
        rjt.JaxConfig(env_vars={"PATHS": ["a"]})


_CACHE_STAGE = """
import glob, json, os, sys
import jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from ray_jax_train._cache_repair import drop_unreadable_entries
assert drop_unreadable_entries() and drop_unreadable_entries()
jax.jit(lambda x: jnp.sin(x) * 3 + 1)(jnp.arange(4.0)).block_until_ready()
print(json.dumps({os.path.basename(p): os.path.getsize(p) for p in glob.glob(os.path.join(sys.argv[1], "*-cache"))}))
"""


def test_a_torn_compilation_cache_entry_is_written_whole_again(tmp_path):
    """JAX writes cache entries in place and never replaces one: a worker killed mid-write left a truncated entry
    that every restart failed to read and compiled again (a failure-injection review). Real JAX, real cache files,
    in fresh processes (the cache is per process); the entries are cut short as a kill would leave them."""
    import subprocess
    import sys

    def stage() -> dict:
        done = subprocess.run([sys.executable, "-c", _CACHE_STAGE, str(tmp_path)], capture_output=True, text=True,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    whole = stage()
    assert whole and min(whole.values()) > 200, whole
    for name in whole:
        os.truncate(tmp_path / name, 100)
    assert stage() == whole  # read, found torn, removed, compiled and written whole


def test_compilation_cache_defaults_to_the_run_storage(tmp_path, monkeypatch):
    from ray.train import RunConfig

    def loop():
        pass

    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/tmp/shared")  # JAX's own variable: one cache for all runs
    assert rjt.JaxTrainer(loop).jax_config.compilation_cache_dir == "/tmp/shared"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")

    local = rjt.JaxTrainer(loop, run_config=RunConfig(name="r", storage_path=str(tmp_path)))
    assert local.jax_config.compilation_cache_dir == str(tmp_path / "r" / "compilation_cache")
    # Named for the workers the way Ray configures them: it was replaced by the run's own cache.
    theirs = rjt.JaxTrainer(loop, run_config=RunConfig(name="r", storage_path=str(tmp_path), worker_runtime_env={
        "env_vars": {"JAX_COMPILATION_CACHE_DIR": "/tmp/mycache"}}))
    assert theirs.jax_config.worker_env()["JAX_COMPILATION_CACHE_DIR"] == "/tmp/mycache"
    chosen = rjt.JaxTrainer(loop, jax_config=rjt.JaxConfig(compilation_cache_dir="/tmp/cc"),
                            run_config=RunConfig(name="r", storage_path=str(tmp_path)))
    assert chosen.jax_config.compilation_cache_dir == "/tmp/cc"
    off = rjt.JaxTrainer(loop, jax_config=rjt.JaxConfig(compilation_cache=False),
                         run_config=RunConfig(name="r", storage_path=str(tmp_path)))
    assert off.jax_config.compilation_cache_dir is None and "JAX_COMPILATION_CACHE_DIR" not in off.jax_config.worker_env()
    # JAX writes its cache through a local path; a bucket needs an explicit directory.
    remote = rjt.JaxTrainer(loop, run_config=RunConfig(name="r", storage_path="s3://bucket/runs"))
    assert remote.jax_config.compilation_cache_dir is None
    # gs:// is one JAX writes itself, with gcsfs: TPU runs keep their storage there and compile for minutes. Whether
    # gcsfs is installed is stood in for (the test extras leave it out).
    import importlib.util

    from ray_jax_train.backend import place_compilation_cache

    real = importlib.util.find_spec
    for installed, expected in ((True, "gs://bucket/runs/r/compilation_cache"), (False, None)):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: (
            (object() if installed else None) if name == "gcsfs" else real(name, *a, **k)))
        config = rjt.JaxConfig(platform="tpu")
        place_compilation_cache(config, RunConfig(name="r", storage_path="gs://bucket/runs/"))
        assert config.compilation_cache_dir == expected
        cpu = rjt.JaxConfig(platform="cpu")  # every CPU program is cached, however small: not a bucket write each
        place_compilation_cache(cpu, RunConfig(name="r", storage_path="gs://bucket/runs/"))
        assert cpu.compilation_cache_dir is None


def test_train_loop_with_two_arguments_is_rejected():
    def two(config, extra):
        pass

    with pytest.raises(ValueError, match="takes 2 required arguments"):
        rjt.JaxTrainer(two)

    def keyword(config, *, extra):
        pass

    with pytest.raises(ValueError, match=r"required keyword-only arguments \['extra'\]"):
        rjt.JaxTrainer(keyword)

    def defaulted(config, *, extra=1):
        pass

    rjt.JaxTrainer(defaulted)

    class Loop:  # Ray would build one per worker and train nothing (a Python API review)
        def __init__(self):
            pass

    with pytest.raises(TypeError, match="is the class .*Loop; calling it only builds an instance"):
        rjt.JaxTrainer(Loop)


def test_datasets_that_are_not_ray_datasets_and_a_mask_key_the_data_has_are_refused():
    """A torch user's review: a numpy array in datasets= failed in every worker as "'numpy.ndarray' object has no
    attribute 'name'"; remainder='pad' silently replaced the data's own 'valid' column with its mask."""
    import ray.data

    from ray_jax_train.data import _pad

    def loop():
        pass

    with pytest.raises(TypeError, match=r"datasets\['train'\] is a ndarray, not a ray.data.Dataset.*from_numpy"):
        rjt.JaxTrainer(loop, datasets={"train": np.arange(4)})
    with pytest.raises(TypeError, match="datasets must be a dict"):
        rjt.JaxTrainer(loop, datasets=[ray.data.range(4)])
    rjt.JaxTrainer(loop, datasets={"train": ray.data.range(4), "made": lambda: ray.data.range(4)})
    # Settings of the wrong kind failed deep in Ray ("'dict' object has no attribute 'use_tpu'"), storage problems in
    # Ray's controller (a Python API review); a relative storage path is the driver's, as RayDistributedTrainer's.
    from ray.train import RunConfig

    with pytest.raises(TypeError, match="scaling_config must be a ray.train.ScalingConfig, got a dict"):
        rjt.JaxTrainer(loop, scaling_config={"num_workers": 1})
    with pytest.raises(TypeError, match="run_config must be a ray.train.RunConfig, got a builtins.dict"):
        rjt.JaxTrainer(loop, run_config={"name": "x"})
    with pytest.raises(TypeError, match="train_loop_config must be a dict"):
        rjt.JaxTrainer(loop, train_loop_config=[1, 2])
    from ray.train import ScalingConfig

    for bad in (-1, "1", None, True):  # a negative count was retried for ever as a placement Ray could never make
        with pytest.raises(ValueError, match=r"'CPU' must be a number of at least 0, got"):
            rjt.JaxTrainer(loop, scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": bad}))
    rjt.JaxTrainer(loop, scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": np.float64(0.5)}))
    with pytest.raises(ValueError, match="is a file, not a directory"):
        rjt.JaxTrainer(loop, run_config=RunConfig(storage_path=__file__))
    relative = rjt.JaxTrainer(loop, run_config=RunConfig(name="r", storage_path="runs"))
    assert relative.run_config.storage_path == os.path.abspath("runs") and relative.run_config.name == "r"
    # every_row names that are not datasets, or that the split leaves whole: the eval set would lose rows again.
    with pytest.raises(ValueError, match=r"every_row=\['evl'\]\) names datasets the trainer was not given.*'eval'"):
        rjt.JaxTrainer(loop, datasets={"train": ray.data.range(4), "eval": ray.data.range(4)},
                       dataset_config=rjt.JaxDataConfig(every_row="evl"))
    with pytest.raises(ValueError, match=r"every_row=\['eval'\]\) names datasets that datasets_to_split"):
        rjt.JaxDataConfig(datasets_to_split=["train"], every_row=["eval"])
    assert rjt.JaxDataConfig(every_row="eval").every_row == ["eval"]
    # In one process, a column that changes dtype or row shape between reads (nulls, ragged lists) is named.
    from ray_jax_train.data import _ColumnLayout

    reads = [{"id": np.arange(4), "tok": np.ones((4, 2))}, {"id": np.array([1.0, np.nan]), "tok": np.ones((2, 2))}]
    with pytest.raises(ValueError, match=r"column 'id' arrived as int64 rows of shape \(\) in earlier reads and as "
                                         r"float64 .*A null in an integer column"):
        list(_ColumnLayout().checked(reads))
    with pytest.raises(ValueError, match=r"column 'tok' arrived as float64 rows of shape \(2,\) .* shape \(3,\)"):
        list(_ColumnLayout().checked([reads[0], {"id": np.arange(2), "tok": np.ones((2, 3))}]))
    # A dtypes cast of floats to integers: NaN (a null) became -2**31 or True, 300.0 as int8 44, 1.5 as int32 1.
    from ray_jax_train.data import _select

    for values, dtype, fragment in (([1.0, np.nan], np.int32, "holds NaN or inf.*an arbitrary integer"),
                                    ([0.0, np.nan], bool, "holds NaN or inf.*True"),
                                    ([300.0], np.int8, "from 300.0 to 300.0, which the cast would wrap"),
                                    ([1.5, 2.0], np.int32, "and fractions, which the cast would truncate")):
        with pytest.raises(ValueError, match=f"dtypes casts column 'i' from float64 to .*{fragment}"):
            _select({"i": np.array(values)}, None, {"i": dtype})
    assert _select({"i": np.array([1.0, 2.0])}, None, {"i": np.int32})["i"].tolist() == [1, 2]
    # Floats cast to a 64-bit integer are checked against the 32 bits JAX narrows it to without x64: 3e9 fitted
    # int64, then trained as -1294967296 (a data review). An int64 column of the same values was refused already.
    for values, dtype in (([1.0, 3e9], np.int64), ([5e9], np.uint64), (np.array(["1", "3e9"]), np.int64)):
        with pytest.raises(ValueError, match=r"to (u?int64) \(\1 becomes u?int32 on the devices without "
                                             r"jax_enable_x64\).*which the cast would wrap.*jax_enable_x64', True"):
            _select({"i": np.array(values)}, None, {"i": dtype})
    assert _select({"i": np.array([1.0, 2e9])}, None, {"i": np.int64})["i"].tolist() == [1, 2_000_000_000]
    mesh = rjt.make_mesh({"dp": -1})
    for settings, error in (({"columns": "id"}, r"columns='id' must be a list of column names, e.g. columns=\['id'\]"),
                            ({"columns": []}, r"columns=\[\] keeps no column"),
                            ({"local_shuffle_seed": 1}, "shuffles nothing without local_shuffle_buffer_size")):
        with pytest.raises((TypeError, ValueError), match=error):  # before anything is read
            rjt.iter_jax_batches(ray.data.range(8), batch_size=mesh.size, mesh=mesh, **settings)
    batch = {"x": np.ones(3), "valid": np.zeros(3)}
    with pytest.raises(ValueError, match="has a column 'valid' already. Pass mask_key="):
        _pad(batch, 4, "valid")
    assert _pad(batch, 4, "real")["real"].tolist() == [True, True, True, False]


def test_subpackages_are_attributes_of_the_package():
    import subprocess
    import sys

    # A fresh interpreter: in this one the tests have imported the subpackages already.
    code = "import ray_jax_train as r; print(r.tune.run.__name__, r.models.__name__, r.text.pack_documents.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["run", "ray_jax_train.models", "pack_documents"]


def test_omitted_scaling_config_means_one_worker():
    trainer = rjt.JaxTrainer(_loop)
    assert trainer.scaling_config.num_workers == 1
    assert trainer.jax_config.platform == "cpu"


def test_rays_own_jax_config_is_accepted():
    from ray.train.v2.jax import JaxConfig as RayJaxConfig

    trainer = rjt.JaxTrainer(_loop, jax_config=RayJaxConfig(), scaling_config=ScalingConfig(num_workers=2))
    assert isinstance(trainer.jax_config, rjt.JaxConfig)


def test_mesh_sizes_must_match_devices():
    devices = jax.devices()
    assert len(devices) == 4
    assert dict(rjt.make_mesh({"dp": -1, "tp": 2}).shape) == {"dp": 2, "tp": 2}
    with pytest.raises(ValueError, match="multiply to 6 devices, but there are 4"):
        rjt.make_mesh({"dp": 3, "tp": 2})
    with pytest.raises(ValueError, match="only one size can be inferred"):
        rjt.make_mesh({"dp": -1, "tp": -1})
    with pytest.raises(ValueError, match="does not divide"):
        rjt.make_mesh({"dp": -1, "tp": 3})
    with pytest.raises(ValueError, match="only one size can be inferred"):
        rjt.JaxConfig(mesh={"dp": -1, "fsdp": -1})  # caught on the driver, before any worker starts
    # Sizes that cannot fit the workers' devices (2 workers x 2 CPU devices), also on the driver.
    with pytest.raises(ValueError, match=r"does not fit the 4 devices .* multiply to 6 devices, but there are 4"):
        rjt.JaxTrainer(_loop, scaling_config=ScalingConfig(num_workers=2),
                       jax_config=rjt.JaxConfig(num_cpu_devices=2, mesh={"dp": 3, "tp": 2}))
    config = resolve_jax_config(rjt.JaxConfig(num_cpu_devices=2, mesh={"dp": -1, "tp": 2}),
                                ScalingConfig(num_workers=2))
    assert config.mesh == {"dp": -1, "tp": 2}  # fits: dp is inferred in the workers
    # EasyDeL-style MeshSpec (exported, and taken by make_hybrid_mesh) failed in make_mesh and JaxConfig; axes of
    # the wrong shape raised "not enough values to unpack".
    from ray_jax_train.config import MeshSpec

    assert dict(rjt.make_mesh(MeshSpec(axis_names=("dp", "fsdp", "tp"), axis_dims=(1, -1, 1))).shape) == \
        {"dp": 1, "fsdp": 4, "tp": 1}
    assert rjt.JaxConfig(mesh=MeshSpec(axis_names=("dp", "tp"), axis_dims=(-1, 2))).mesh == {"dp": -1, "tp": 2}
    for pairs in (zip(["dp", "tp"], [-1, 2]), {"dp": -1, "tp": 2}.items(), ((n, v) for n, v in [("dp", -1), ("tp", 2)]),
                  np.array([["dp", -1], ["tp", 2]], dtype=object)):
        assert dict(rjt.make_mesh(pairs).shape) == {"dp": 2, "tp": 2}
    for bad in ("dp", [("dp",)], [("dp", 2, 3)], ["dp"], 4):
        with pytest.raises(ValueError, match=r"mesh axes are a mapping such as \{'dp': -1\} or \(name, size\) pairs"):
            rjt.make_mesh(bad)


def test_mesh_keeps_each_process_contiguous():
    mesh = rjt.make_mesh({"dp": 2, "fsdp": 2})
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert ids.tolist() == [[0, 1], [2, 3]]


def test_batch_size_must_divide_over_batch_shards():
    mesh = rjt.make_mesh({"dp": 2, "fsdp": 2})
    assert check_batch_size(8, mesh) == 4
    with pytest.raises(ValueError, match="batch_size=6 is not divisible by the 4 batch shards"):
        check_batch_size(6, mesh)
    # A batch size or mesh size computed with numpy is an integer, not "8 is not divisible by 4".
    assert check_batch_size(np.int64(8), mesh) == 4
    assert rjt.make_mesh({"dp": np.int64(2), "fsdp": np.int32(-1)}).shape == {"dp": 2, "fsdp": 2}
    for bad in (8.0, True, -4):
        with pytest.raises(ValueError, match=f"batch_size={bad!r} .* must be a positive integer"):
            check_batch_size(bad, mesh)
    with pytest.raises(ValueError, match="size 2.0 of type float"):
        rjt.make_mesh({"dp": 2.0, "fsdp": 2})
    tp_only = rjt.make_mesh({"model": 4})
    with pytest.raises(ValueError, match="none of the batch axes"):
        check_batch_size(8, tp_only)


def test_tpu_jobs_are_checked_on_the_driver_from_the_scaling_config(monkeypatch):
    """No TPU exists here: these are Ray's own TPU ScalingConfigs (pure configuration), checked on the driver before
    a slice is reserved. A mesh that does not fit the slice, or workers that split a host's chips, failed only in
    every worker once the slice was up."""
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    v6e = ScalingConfig(use_tpu=True, topology="4x4", accelerator_type="TPU-V6E", num_workers=4)  # 4 hosts x 4 chips
    assert resolve_jax_config(rjt.JaxConfig(mesh={"dp": -1, "tp": 4}), v6e).platform == "tpu"
    with pytest.raises(ValueError, match=r"mesh=.*does not fit the 16 devices"):
        resolve_jax_config(rjt.JaxConfig(mesh={"dp": 3}), v6e)
    # Two devices per chip on v2, v3 and TPU7x (no megacore); one on v4 (megacore).
    v7x = ScalingConfig(use_tpu=True, topology="2x2x2", accelerator_type="TPU-V7X", num_workers=2)
    with pytest.raises(ValueError, match=r"does not fit the 16 devices"):
        resolve_jax_config(rjt.JaxConfig(mesh={"dp": 8, "tp": 1}), v7x)
    resolve_jax_config(rjt.JaxConfig(mesh={"dp": 8, "tp": 2}), v7x)
    v4 = ScalingConfig(use_tpu=True, topology="2x2x2", accelerator_type="TPU-V4", num_workers=2)
    resolve_jax_config(rjt.JaxConfig(mesh={"fsdp": 8}), v4)
    # Half a v6e-8 host each: two libtpu slices of their own, never one job.
    split = ScalingConfig(use_tpu=True, topology="2x4", accelerator_type="TPU-V6E", num_workers=2,
                          resources_per_worker={"TPU": 4})
    with pytest.raises(ValueError, match=r"4 of a TPU host's 8 chips .* Leave 'TPU' out of resources_per_worker .* "
                                         r"num_workers=1 per slice"):
        resolve_jax_config(None, split)
    resolve_jax_config(rjt.JaxConfig(distributed=False), split)  # independent processes may share a host
    one = ScalingConfig(use_tpu=True, resources_per_worker={"TPU": 4})
    assert resolve_jax_config(None, one).platform == "tpu"  # one process on part of a host: Ray sets its bounds
    # Multi-slice: 8 hosts of v6e-16 slices (4 hosts each) are 2 slices, the unit dcn_mesh counts on TPU. A dcn_mesh
    # of another size, or a mesh its blocks do not divide, failed in every worker once both slices were up.
    two = ScalingConfig(use_tpu=True, topology="4x4", accelerator_type="TPU-V6E", num_workers=8)
    resolve_jax_config(rjt.JaxConfig(mesh={"dp": -1, "tp": 4}, dcn_mesh={"dp": 2}), two)
    resolve_jax_config(rjt.JaxConfig(mesh={"dp": -1, "tp": 4}, dcn_mesh={"dp": -1}), two)
    with pytest.raises(ValueError, match=r"dcn_mesh=\{'dp': 4\}\) spans 4 slices, but the run's 8 workers on "
                                         r"topology 4x4 reserve 2 slices .* multiply to 2"):
        resolve_jax_config(rjt.JaxConfig(mesh={"dp": -1, "tp": 4}, dcn_mesh={"dp": 4}), two)
    with pytest.raises(ValueError, match=r"does not fit the 32 devices"):
        resolve_jax_config(rjt.JaxConfig(mesh={"dp": 3, "tp": 4}, dcn_mesh={"dp": 2}), two)
    with pytest.raises(ValueError, match=r"gives dp=1, not divisible by dcn_mesh's dp=2"):
        resolve_jax_config(rjt.JaxConfig(mesh={"dp": 1, "tp": -1}, dcn_mesh={"dp": 2}), two)
    with pytest.raises(ValueError, match=r"spans 2 processes, but with distributed=False"):
        resolve_jax_config(rjt.JaxConfig(mesh={"dp": -1}, dcn_mesh={"dp": 2}, distributed=False), two)


def test_tpu_compiler_flags_go_to_libtpu_and_a_tpu_that_fails_to_start_is_retried(monkeypatch):
    """jaxlib exits on XLA_FLAGS it does not know, and libtpu reads its own flags from LIBTPU_INIT_ARGS. A TPU backend
    that fails to start (a TPU the last attempt still holds) is a start-up error Ray retries; a missing libtpu is not.
    The not-installed case is real (this machine has no libtpu): the backend starts in a fresh process."""
    from ray_jax_train.backend import _backend_not_installed

    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_use_enhanced_launch_barrier=true")
    env = rjt.JaxConfig(platform="tpu", xla_flags=["--xla_tpu_enable_async_all_gather=true", "--xla_dump_to=/tmp/d",
                                                   "--megascale_grpc_premap_memory_bytes=1"]).worker_env({})
    assert env["LIBTPU_INIT_ARGS"] == ("--xla_tpu_use_enhanced_launch_barrier=true "
                                       "--xla_tpu_enable_async_all_gather=true --megascale_grpc_premap_memory_bytes=1")
    assert env["XLA_FLAGS"].split()[-1] == "--xla_dump_to=/tmp/d" and "tpu" not in env["XLA_FLAGS"]
    cpu = rjt.JaxConfig(platform="cpu", xla_flags=["--xla_tpu_x=1"]).worker_env({})
    assert "LIBTPU_INIT_ARGS" not in cpu and cpu["XLA_FLAGS"].endswith("--xla_tpu_x=1")  # only TPU moves them

    code = ("import socket, sys\nfrom ray_jax_train.backend import JaxConfig, _setup_worker\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
            "try:\n    _setup_worker(f'127.0.0.1:{port}', 1, 0, JaxConfig(platform='tpu', compilation_cache=False), {})\n"
            "except Exception as exc:\n    print(type(exc).__name__, exc)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env).stdout
    assert out.startswith("RuntimeError JAX in worker 0 could not start its TPU backend") and "jax[tpu]" in out, out
    assert not _backend_not_installed(RuntimeError("TPU initialization failed: The TPU is already in use by process "
                                                   "with pid 1234."))


def test_tpu_multislice_env_from_rays_utility():
    """Simulated TPU: no TPU exists here, so this checks the per-worker MEGASCALE_* plan only."""
    envs = multislice_env(num_workers=4, num_slices=2, workers_per_slice=2, coordinator_ip="10.0.0.1")
    assert [e["MEGASCALE_SLICE_ID"] for e in envs] == ["0", "0", "1", "1"]
    assert {e["MEGASCALE_NUM_SLICES"] for e in envs} == {"2"}
    assert all(e["MEGASCALE_COORDINATOR_ADDRESS"].startswith("10.0.0.1") for e in envs)
    assert multislice_env(2, 1, 2, "10.0.0.1") == [{}, {}]


def test_gpu_workers_get_distinct_gpus(ray_cluster):
    """Logical GPUs (the cluster declares 2, there is no CUDA here): two 1-GPU workers never share one."""
    import ray

    @ray.remote(num_gpus=1)
    def plan(rank):
        return assigned_gpus(rank)

    plans = ray.get([plan.remote(0), plan.remote(1)])
    visible = sorted(p[0] for p in plans)
    assert visible == ["0", "1"]
    assert all(p[1] == [0] for p in plans)

    @ray.remote(num_gpus=0)
    def none():
        return assigned_gpus(0)

    with pytest.raises(ray.exceptions.RayTaskError, match="given no GPU"):
        ray.get(none.remote())


def test_workers_that_take_every_cpu_are_refused_before_hanging(ray_cluster):
    import ray.data

    trainer = rjt.JaxTrainer(_loop, scaling_config=ScalingConfig(num_workers=4), datasets={"d": ray.data.range(4)})
    with pytest.raises(ValueError, match="Ray Data would have no CPU"):
        trainer.fit()
    # Rows already in the object store need no Data task: Ray's own JaxTrainer trains beside them on every CPU.
    from ray_jax_train.trainer import _needs_data_tasks

    assert not _needs_data_tasks({"d": ray.data.from_items([{"x": 1}]), "e": ray.data.range(4).materialize()})
    assert _needs_data_tasks({"d": ray.data.from_items([{"x": 1}]).map(lambda r: r)})
    assert not _needs_data_tasks(None) and not _needs_data_tasks({})


def test_distributed_false_checks_the_mesh_against_one_workers_devices():
    assert rjt.JaxConfig().distributed is True  # one jax.distributed job is the default
    two_workers = ScalingConfig(num_workers=2)
    # Each worker is its own JAX process with 2 CPU devices: a 2-device mesh fits, a 4-device one does not ...
    config = resolve_jax_config(rjt.JaxConfig(distributed=False, num_cpu_devices=2, mesh={"dp": 2}), two_workers)
    assert config.distributed is False and config.to_dict()["distributed"] is False
    with pytest.raises(ValueError, match=r"does not fit the 2 devices each worker \(distributed=False\)"):
        resolve_jax_config(rjt.JaxConfig(distributed=False, num_cpu_devices=2, mesh={"dp": 4}), two_workers)
    # ... while one job over both workers has 4.
    with pytest.raises(ValueError, match="does not fit the 4 devices the workers"):
        resolve_jax_config(rjt.JaxConfig(num_cpu_devices=2, mesh={"dp": 2}), two_workers)


def test_user_jax_platforms_is_kept_when_it_agrees_and_refused_when_not(monkeypatch):
    from ray.train import RunConfig

    gpu = ScalingConfig(num_workers=1, use_gpu=True)
    # Kept: it leads with the run's platform, and keeps the CPU backend next to the GPU one.
    config = resolve_jax_config(rjt.JaxConfig(env_vars={"JAX_PLATFORMS": "cuda,cpu"}), gpu)
    assert config.platform == "gpu" and config.worker_env()["JAX_PLATFORMS"] == "cuda,cpu"
    # The worker's own environment (runtime_env or inherited) counts too; any JAX name of a GPU does.
    assert rjt.JaxConfig(platform="gpu").worker_env({"JAX_PLATFORMS": "rocm"})["JAX_PLATFORMS"] == "rocm"
    assert rjt.JaxConfig(platform="cpu").worker_env({"JAX_PLATFORMS": "cpu,cuda"})["JAX_PLATFORMS"] == "cpu,cuda"
    # An inherited value that disagrees (a driver keeping itself on the CPU, on a local Ray) gives way.
    assert rjt.JaxConfig(platform="gpu").worker_env({"JAX_PLATFORMS": "cpu"})["JAX_PLATFORMS"] == "cuda"
    # Values the driver knows the workers get are refused when they contradict the platform, naming both.
    with pytest.raises(ValueError, match=r"JAX_PLATFORMS='cpu' in JaxConfig\(env_vars=...\) contradicts the "
                                         r"platform 'gpu'.*start it with 'cuda'"):
        resolve_jax_config(rjt.JaxConfig(env_vars={"JAX_PLATFORMS": "cpu"}), gpu)
    with pytest.raises(ValueError, match=r"RunConfig\(worker_runtime_env=...\).*would default to 'cpu'"):
        resolve_jax_config(None, gpu, RunConfig(worker_runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu,cuda"}}))
    # The driver's own JAX_PLATFORMS only picks a default platform; it may keep the driver itself on the CPU.
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert resolve_jax_config(None, gpu).platform == "gpu"


def test_shutdown_timeout_follows_rays_variable_unless_set(monkeypatch):
    one = ScalingConfig(num_workers=1)
    monkeypatch.delenv("JAX_DISTRIBUTED_SHUTDOWN_TIMEOUT_S", raising=False)
    assert resolve_jax_config(None, one).shutdown_timeout_s == 60
    monkeypatch.setenv("JAX_DISTRIBUTED_SHUTDOWN_TIMEOUT_S", "7")
    assert resolve_jax_config(None, one).shutdown_timeout_s == 7
    assert resolve_jax_config(rjt.JaxConfig(shutdown_timeout_s=5), one).shutdown_timeout_s == 5


def test_other_backend_configs_are_refused():
    from ray.train.backend import BackendConfig
    from ray.train.v2.jax import JaxConfig as RayJaxConfig

    with pytest.raises(TypeError, match=r"got ray\.train\S*\.BackendConfig\. Pass rjt\.JaxConfig"):
        rjt.JaxTrainer(_loop, jax_config=BackendConfig())

    class MyRayJaxConfig(RayJaxConfig):
        pass

    trainer = rjt.JaxTrainer(_loop, jax_config=MyRayJaxConfig(use_gpu=True),
                             scaling_config=ScalingConfig(num_workers=1, use_gpu=True))
    assert isinstance(trainer.jax_config, rjt.JaxConfig) and trainer.jax_config.platform == "gpu"


def test_local_mode_runs_the_loop_here_without_starting_ray(monkeypatch, caplog):
    import ray
    from ray.train.v2._internal.execution import train_fn_utils

    # Local mode leaves its in-process train context set; give it back to later tests as it was.
    monkeypatch.setattr(train_fn_utils, "_train_fn_utils", None)
    ray_was_up = ray.is_initialized()

    def loop():
        import ray_jax_train as rjt

        errors = []
        try:  # local mode has no run storage: say so, not Ray's "Local storage context not yet implemented"
            rjt.JaxCheckpointer().restore({})
        except RuntimeError as exc:
            errors.append(str(exc))
        try:  # a name typo: the message workers give, not a bare AssertionError
            rjt.iter_jax_batches("trian", batch_size=4, mesh=rjt.get_mesh())
        except ValueError as exc:
            errors.append(str(exc))
        return dict(rjt.get_mesh().shape), errors

    with caplog.at_level("WARNING", logger="ray_jax_train.trainer"):
        # A mesh that fits no worker: local mode does not apply it, so the driver does not check it.
        trainer = rjt.JaxTrainer(loop, scaling_config=ScalingConfig(num_workers=0),
                                 jax_config=rjt.JaxConfig(mesh={"dp": 3}))
    assert "local mode" in caplog.text and "not applied" in caplog.text
    result = trainer.fit()
    shape, errors = result.return_value
    assert shape == {"dp": 4}  # this process's 4 CPU devices (conftest)
    assert len(errors) == 2 and "Checkpoints need a run with Ray Train workers" in errors[0], errors
    assert "No dataset named 'trian' was given to the trainer" in errors[1], errors
    assert ray.is_initialized() == ray_was_up


def test_cpu_headroom_check_uses_rays_cpu_count(ray_cluster, caplog):
    from ray_jax_train.trainer import ensure_ray_leaves_cpu_for_data, worker_cpus

    assert worker_cpus(ScalingConfig(num_workers=2)) == 1
    assert worker_cpus(ScalingConfig(num_workers=2, use_gpu=True)) == 0  # Ray reserves no CPU for GPU workers
    assert worker_cpus(ScalingConfig(num_workers=2, resources_per_worker={"CPU": 2})) == 2
    # The session cluster has 4 CPUs. GPU workers take none of them.
    ensure_ray_leaves_cpu_for_data(ScalingConfig(num_workers=8, use_gpu=True), True)
    # Workers that do not fit yet wait for Ray (an autoscaler may add nodes): a warning, not an error.
    with caplog.at_level("WARNING", logger="ray_jax_train.trainer"):
        ensure_ray_leaves_cpu_for_data(ScalingConfig(num_workers=8), True)
    assert "need 8 CPUs but the cluster has 4" in caplog.text
    # Workers that fit but take every CPU would starve Ray Data for ever.
    with pytest.raises(ValueError, match="Ray Data would have no CPU"):
        ensure_ray_leaves_cpu_for_data(ScalingConfig(num_workers=2, resources_per_worker={"CPU": 2}), True)


def test_a_running_ray_start_cluster_is_named_before_a_private_ray_starts(tmp_path, caplog):
    """`ray start` records its address in <temp dir>/ray_current_cluster; a record whose GCS is gone is stale."""
    import socket

    from ray_jax_train.trainer import _warn_if_ray_start_cluster_runs

    assert _warn_if_ray_start_cluster_runs(str(tmp_path)) is None  # nothing recorded
    gcs = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{gcs.getsockname()[1]}"
    (tmp_path / "ray_current_cluster").write_text(address)
    with caplog.at_level("WARNING", logger="ray_jax_train.trainer"):
        assert _warn_if_ray_start_cluster_runs(str(tmp_path)) == address
    assert address in caplog.text and "RAY_ADDRESS=auto" in caplog.text and "ray.init()" in caplog.text
    gcs.close()
    caplog.clear()
    with caplog.at_level("WARNING", logger="ray_jax_train.trainer"):
        assert _warn_if_ray_start_cluster_runs(str(tmp_path)) is None  # killed without `ray stop`
    assert not caplog.text


def test_iterator_settings_that_would_spin_or_grow_without_bound_are_refused():
    mesh = rjt.make_mesh({"dp": -1})
    with pytest.raises(ValueError, match="sync_window=0 must be a positive integer"):  # agreed on 0 batches forever
        rjt.iter_jax_batches("train", batch_size=4, mesh=mesh, sync_window=0)
    with pytest.raises(ValueError, match=r"skip_batches=1.5 must be a whole number"):  # skipped every batch
        rjt.iter_jax_batches("train", batch_size=4, mesh=mesh, skip_batches=1.5)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):  # 'NoneType' has no 'axis_names'
        rjt.iter_jax_batches("train", batch_size=4, mesh=None)
    with pytest.raises(ValueError, match="dtypes: 'int33' for column 'id' is not a dtype"):
        rjt.iter_jax_batches("train", batch_size=4, mesh=mesh, dtypes={"id": "int33"})
    with pytest.raises(ValueError, match="prefetch=0 must be a positive integer"):  # Queue(maxsize=0) is unbounded
        rjt.ResumableBatches({"x": np.arange(16)}, batch_size=4, mesh=mesh, prefetch=0)


def test_a_dataset_short_of_one_batch_says_why_it_gave_none(ray_cluster, caplog):
    """A drop-in loop over fewer rows than one batch ran zero steps and ended as if it had trained (fit() then
    returned success with no metrics); later a warning said why; now it is an error."""
    import ray.data

    mesh = rjt.make_mesh({"dp": -1})
    with pytest.raises(rjt.NoFullBatchError, match=r"gave no batch although this process read 3 rows.*remainder='pad'"):
        list(rjt.iter_jax_batches(ray.data.range(3), batch_size=4, mesh=mesh))
    with pytest.raises(rjt.NoFullBatchError, match="the data gave no rows at all"):  # trained nothing, "succeeded"
        list(rjt.iter_jax_batches(ray.data.range(6).filter(lambda row: False), batch_size=4, mesh=mesh))
    # A tail dropped after a batch, or batches skipped on resume, are no surprise.
    assert len(list(rjt.iter_jax_batches(ray.data.range(6), batch_size=4, mesh=mesh))) == 1
    assert list(rjt.iter_jax_batches(ray.data.range(6), batch_size=4, mesh=mesh, skip_batches=1)) == []
    assert "skip_batches" not in caplog.text  # skipped to the end: a position saved on the epoch's last batch
    # Past the end: a resume whose saved position no longer fits the data gave nothing without a word (a review).
    with caplog.at_level(logging.WARNING, logger="ray_jax_train.data"):
        assert list(rjt.iter_jax_batches(ray.data.range(6), batch_size=4, mesh=mesh, skip_batches=3)) == []
    assert "skip_batches=3): the data holds only 1 global batches" in caplog.text


class _MyDataIsWrong(ValueError):  # a custom loop's own error, marked (module level: pickled by name)
    retry_repeats_it = True


def test_retries_skip_errors_that_every_attempt_would_repeat():
    """Ray's own policy, decided on the errors as workers raise them: a checkpoint of another model (in a custom
    loop too), NaN, unreadable data end the run at the first attempt, even with max_failures=-1 (it restarted the
    group forever); a lost worker is still retried up to max_failures. The built-in loop's end-to-end case is
    test_lm_loop's no-loss-tokens test."""
    import pickle

    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2.api.exceptions import WorkerGroupError

    from ray_jax_train.checkpoint import CheckpointMismatchError
    from ray_jax_train.retries import RetriesSkipRepeatedErrors, marking_repeated_errors, repeats_on_retry
    from ray_jax_train.text.errors import EmptyDatasetError, MissingColumnError

    def failed(*errors):
        return WorkerGroupError("failed", dict(enumerate(errors)))

    def as_the_controller_gets_it(error):  # raised in the worker's loop, pickled on its way
        def loop():
            raise error

        try:
            marking_repeated_errors(loop)()
        except BaseException as raised:  # noqa: BLE001
            return pickle.loads(pickle.dumps(raised))

    lost = RuntimeError("The actor died unexpectedly before finishing this task.")
    wrapped = RuntimeError("reading the data failed")
    wrapped.__cause__ = MissingColumnError("no text column")
    # The chain is lost on the way (a review: a wrapped error was retried); the worker's mark is not.
    assert not repeats_on_retry(pickle.loads(pickle.dumps(wrapped)))
    # The library's own refusals of how it is called, in a worker's loop (a review: a loop that reported, then
    # saved a state it had not placed, restarted forever with max_failures=-1).
    from ray_jax_train.sharding import PartitionRules

    usage = []
    for call in (lambda: rjt.make_mesh({"dp": 3}), lambda: PartitionRules([("w",)]),
                 lambda: rjt.JaxCheckpointer(save_every=0)):
        with pytest.raises(ValueError) as refused:
            call()
        usage.append(refused.value)
    unwritable = RuntimeError("saving the model failed")
    unwritable.__cause__ = PermissionError(errno.EACCES, "Permission denied", "/runs/x/final_model")
    for repeated in (CheckpointMismatchError("shapes differ"), wrapped, _MyDataIsWrong("bad"),
                     rjt.NonFiniteLossError("nan"), rjt.NoFullBatchError("too few rows"), unwritable,
                     OSError(errno.EROFS, "Read-only file system"), *usage):
        policy = RetriesSkipRepeatedErrors(FailureConfig(max_failures=-1))
        decision = policy.make_decision(failed(lost, as_the_controller_gets_it(repeated)))
        assert decision == FailureDecision.RAISE, repeated
    policy = RetriesSkipRepeatedErrors(FailureConfig(max_failures=2))
    transient = as_the_controller_gets_it(EmptyDatasetError("no files found under ['/mnt/shared/data']"))
    assert [policy.make_decision(failed(lost)), policy.make_decision(failed(transient)),
            policy.make_decision(failed(lost))] == [FailureDecision.RETRY] * 2 + [FailureDecision.RAISE]
    # Attempts that reported nothing, in a row, end the run at the limit whatever max_failures allows; one that
    # reported starts the count again.
    from ray_jax_train import retries

    policy = RetriesSkipRepeatedErrors(FailureConfig(max_failures=-1), without_progress=3)
    decisions = []
    for reported in (1, 0, 0, 1, 0, 0, 0):
        retries._reports_seen += reported
        decisions.append(policy.make_decision(failed(lost)))
    assert decisions == [FailureDecision.RETRY] * 6 + [FailureDecision.RAISE]
    # Reports with a step: only a step past the furthest reported is progress (a resumed attempt reports the step
    # it resumed at again), whichever worker gives it, or a checkpoint (a step counted from 0 each epoch).
    from types import SimpleNamespace

    policy = RetriesSkipRepeatedErrors(FailureConfig(max_failures=-1), without_progress=2)
    decisions = []
    for steps in ([4], [4], [5], [], [1, "saved"], [2], [2, 5]):
        for step in steps:
            saved = SimpleNamespace(checkpoint=object() if step == "saved" else None)
            retries.CountsReports().after_report(saved, [{"step": 3 if step == "saved" else step, "loss": 1.0}, {}])
        decisions.append(policy.make_decision(failed(lost)))
    assert decisions == [FailureDecision.RETRY] * 6 + [FailureDecision.RAISE], decisions
    # The driver sees the run's error, the workers' inside it (the CLI's resume line says to fix the cause first).
    assert repeats_on_retry(failed(lost, rjt.NonFiniteLossError("nan"))) and not repeats_on_retry(failed(lost))
    assert not repeats_on_retry(ConnectionError(errno.ECONNRESET, "reset")) and not repeats_on_retry(OSError(errno.EIO, "io"))


def test_a_call_the_library_refuses_ends_the_run_at_its_first_attempt_though_it_reported(ray_cluster, tmp_path):
    """A loop that reported, then called save_and_report with nothing to save (a plain ValueError then): each
    attempt reported (progress, so the rule below never stopped it) and failed alike, and FailureConfig restarted
    the group max_failures times, forever with -1 (a review). Now the first attempt's error is the run's."""
    from ray.train import FailureConfig, RunConfig
    from ray.train.v2.api.exceptions import WorkerGroupError

    attempts = tmp_path / "attempts"
    attempts.mkdir()

    def loop():
        import os

        import ray.train

        import ray_jax_train as rjt

        n = len(os.listdir(attempts)) + 1
        open(attempts / str(n), "w").close()
        ray.train.report({"attempt": n})
        rjt.save_and_report(1, {})

    with pytest.raises(WorkerGroupError) as failed:
        rjt.JaxTrainer(loop, scaling_config=ScalingConfig(num_workers=1),
                       run_config=RunConfig(name="refused-call", storage_path=str(tmp_path / "runs"),
                                            failure_config=FailureConfig(max_failures=2))).fit()
    assert sorted(os.listdir(attempts)) == ["1"], os.listdir(attempts)
    assert "UsageValueError" in str(failed.value) and "the state has no leaves to save" in str(failed.value)


def test_attempts_that_die_before_their_first_report_end_the_run(ray_cluster, tmp_path, monkeypatch):
    """A worker killed for memory at its first step looks like a lost worker to Ray, and with max_failures=-1 the
    group restarted forever, each attempt from the same place. So did attempts that resumed, reported again the step
    they resumed at, and failed there (a final model that could not be written; a review). Attempts that reported a
    step past the furthest before (progress) do not count: here attempt 1 reports step 1 and dies, attempt 2
    reports step 1 again and dies, attempt 3 dies at once; with a limit of 2 the run ends at attempt 3, not 2 or 4
    (the policy and the report counter reach the controller as separate arguments: this checks they still meet)."""
    from ray.train import FailureConfig, RunConfig
    from ray.train.v2.api.exceptions import WorkerGroupError

    from ray_jax_train.retries import RETRIES_WITHOUT_PROGRESS, why_not_retried

    attempts = tmp_path / "attempts"
    attempts.mkdir()

    def loop():
        import os
        import time

        import ray.train

        n = len(os.listdir(attempts)) + 1
        open(attempts / str(n), "w").close()
        if n <= 2:
            ray.train.report({"step": 1, "attempt": n})
            time.sleep(1)  # the controller collects reports at its next poll of the worker (0.1 s)
        os._exit(1)  # as the kernel's OOM killer would

    monkeypatch.setenv(RETRIES_WITHOUT_PROGRESS, "2")
    with pytest.raises(WorkerGroupError) as failed:
        rjt.JaxTrainer(loop, scaling_config=ScalingConfig(num_workers=1),
                       run_config=RunConfig(name="no-progress", storage_path=str(tmp_path / "runs"),
                                            failure_config=FailureConfig(max_failures=-1))).fit()
    assert len(os.listdir(attempts)) == 3, os.listdir(attempts)
    assert "errors:\nStopped retrying: 2 attempts in a row failed before their first report or before reporting a " \
           "step past the furthest one reported" in str(failed.value)
    assert why_not_retried(failed.value).endswith("lets max_failures retry them.")
    assert "A worker health check failed" in str(failed.value)  # Ray's own account follows

    monkeypatch.setenv(RETRIES_WITHOUT_PROGRESS, "two")
    with pytest.raises(ValueError, match="RAY_JAX_TRAIN_RETRIES_WITHOUT_PROGRESS='two'"):
        rjt.JaxTrainer(loop, run_config=RunConfig(name="bad-limit", storage_path=str(tmp_path / "runs")))


def test_the_orbax_guard_waits_for_the_loop_to_import_orbax():
    """Installing it imported orbax in every multi-process worker (~0.9 s of each start-up); now it is installed
    when orbax is imported, by whatever imports it (the checkpoint package here), and wraps both savers."""
    code = """
import sys
from ray_jax_train._after_import import call_after_import
from ray_jax_train.backend import _install_orbax_guard
call_after_import("orbax.checkpoint", _install_orbax_guard)
call_after_import("orbax.checkpoint", _install_orbax_guard)  # a second group start in the same worker
import importlib.util
assert importlib.util.find_spec("orbax.checkpoint") is not None  # a lookup (is orbax installed?) is no import
assert "orbax.checkpoint" not in sys.modules
import ray_jax_train.checkpoint
import orbax.checkpoint as ocp
assert ocp.Checkpointer.save._ray_jax_train_guard and ocp.AsyncCheckpointer.save._ray_jax_train_guard
assert ocp.__spec__.loader is ocp.__loader__ and type(ocp.__loader__).__name__ == "SourceFileLoader"
assert not [f for f in sys.meta_path if type(f).__module__ == "ray_jax_train._after_import"]
call_after_import("orbax.checkpoint", lambda: print("at once"))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "at once", done.stdout + done.stderr[-3000:]


def test_workers_after_the_first_wait_for_the_coordinator_to_listen():
    """A client that dials before process 0's service listens waits out gRPC's 1 s reconnect backoff: each
    multi-process start paid ~1 s. The wait returns once the port accepts, and at its timeout when nothing does."""
    import socket
    import threading
    import time

    from ray_jax_train.backend import _wait_for_coordinator

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    timer = threading.Timer(0.3, server.listen)
    timer.start()
    started = time.monotonic()
    _wait_for_coordinator(f"127.0.0.1:{port}", 30)
    assert 0.25 < time.monotonic() - started < 5
    server.close()
    started = time.monotonic()
    _wait_for_coordinator(f"127.0.0.1:{port}", 1)  # nothing listens: initialize reports it after this
    assert 0.9 < time.monotonic() - started < 5


def test_a_worker_that_stops_iterating_early_fails_the_others_saying_why(ray_cluster, tmp_path):
    """One rank that stopped reading mid-epoch left the others waiting silently for the whole sync timeout (30
    minutes), then failing with a bare DEADLINE_EXCEEDED naming a key. Now the others fail at once where it returned
    or waits in ray.train.report, warn while they wait, and at the deadline say who never came and why. A wait's
    warning named the waiting process itself (and every later one) as missing."""
    import ray.data
    from ray.train import RunConfig

    out = tmp_path / "out"
    out.mkdir()

    def loop():
        import logging
        import time

        import ray.train

        from ray_jax_train import data

        data._Agreement.warn_after_s = 0.3
        rank = ray.train.get_context().get_world_rank()
        warnings = []
        handler = logging.Handler()

        def emit(record):
            warnings.append(record.getMessage())
            (out / f"warned{rank}").touch()

        handler.emit = emit
        logging.getLogger("ray_jax_train.data").addHandler(handler)
        mesh = rjt.get_mesh()

        def read(name, then, timeout_s):
            batches = rjt.iter_jax_batches(name, batch_size=2, mesh=mesh, sync_window=1, sync_timeout_s=timeout_s)
            try:
                for i, _ in enumerate(batches):
                    if rank == 1 and i == 2:
                        batches.close()
                        (out / f"left-{name}.tmp").write_text(repr(time.time()))
                        (out / f"left-{name}.tmp").rename(out / f"left-{name}")
                        return then()
            except Exception as exc:  # noqa: BLE001
                failed_at = time.time()
                (out / name).touch()
                # Timed from rank 1's leaving, not from this read's start: opening the iterator on a loaded CI
                # machine took up to 20 s of its own.
                wait_for(f"left-{name}")
                left = float((out / f"left-{name}").read_text())
                return [failed_at - left, f"{type(exc).__name__}: {exc}"]

        def wait_for(flag):
            for _ in range(200):
                if (out / flag).exists():
                    return
                time.sleep(0.1)

        if rank == 0:
            wait_for("warned1")  # rank 1 warns that it waits for process 0 to open (only that one)
        # Rank 1 neither returns nor reports until rank 0 is past the deadline.
        results = {"deadline": read("a", lambda: wait_for("a"), 2),
                   "report": read("b", lambda: ray.train.report({}), 90)}
        if rank == 0:
            ray.train.report({})  # where rank 1 waits
        results["returned"] = read("c", lambda: None, 90)
        (out / f"{rank}.json").write_text(json.dumps({"warnings": warnings, **results}))

    datasets = {name: ray.data.range(20) for name in "abc"}
    rjt.JaxTrainer(loop, scaling_config=ScalingConfig(num_workers=2), datasets=datasets,
                   run_config=RunConfig(name="early", storage_path=str(tmp_path / "runs"))).fit()
    first, second = (json.loads((out / f"{rank}.json").read_text()) for rank in (0, 1))
    opening = [w for w in second["warnings"] if "to open their matching iterator" in w]
    assert opening and "for processes [0] to open" in opening[0], second["warnings"]
    assert any("for processes [1] to read their share of batch" in w for w in first["warnings"]), first["warnings"]
    waited, error = first["deadline"]
    assert error.startswith("RuntimeError: ") and "for processes [1], whose readers never reached it" in error, error
    # Bounds against the hang, not timings: 2 s is this phase's deadline, 90 s the others' (a loaded CI machine);
    # each is timed from rank 1's leaving the loop, so it cannot include opening the iterator.
    assert "Break out of the loop on every worker together" in error and waited < 45, (waited, error)
    waited, error = first["report"]
    assert error.startswith("IteratorsOutOfStepError: ") and "which process 1 will never read: it waits in " \
        "ray.train.report" in error and waited < 45, (waited, error)
    waited, error = first["returned"]
    assert "which process 1 will never read: its training function has already returned" in error, error
    assert waited < 45, waited


def test_data_errors_end_the_run_at_the_first_attempt():
    """Columns iter_jax_batches refuses (text, nested, ragged, nulls, overflow, a dtypes typo, a changed layout) were
    plain TypeError/ValueError: FailureConfig retried them, forever with max_failures=-1, each attempt reading the
    same data. They stay TypeError/ValueError, and say that a retry repeats them."""
    import pickle
    import re

    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2.api.exceptions import WorkerGroupError

    from ray_jax_train.data import _ColumnLayout, _select
    from ray_jax_train.retries import RetriesSkipRepeatedErrors, marking_repeated_errors

    def objects(*items):
        column = np.empty(len(items), dtype=object)
        column[:] = items
        return column

    bad = [({"t": objects("a", "b")}, None, TypeError, "holds text"),
           ({"n": objects({"x": 1}, {"x": 2})}, None, TypeError, "nested records"),
           ({"r": objects([1, 2], [3])}, None, TypeError, "rows of different shapes"),
           ({"z": objects(1, None)}, None, TypeError, "holds nulls"),
           ({"f": np.array([1e6])}, {"f": np.float16}, ValueError, "would become inf"),
           ({"f": np.array([1.5])}, {"g": np.float32}, ValueError, "dtypes names columns ['g']"),
           ({"f": np.array([np.nan])}, {"f": np.int32}, ValueError, "holds NaN")]
    raised = []
    for batch, dtypes, kind, fragment in bad:
        with pytest.raises(kind, match=re.escape(fragment)) as error:
            _select(batch, None, dtypes)
        raised.append(error.value)
    with pytest.raises(ValueError, match="arrived as int64") as error:
        list(_ColumnLayout().checked(iter([{"x": np.arange(2)}, {"x": np.arange(2.0)}])))
    raised.append(error.value)
    with pytest.raises(ValueError, match="is not a dtype") as error:
        rjt.iter_jax_batches("train", batch_size=4, mesh=rjt.make_mesh({"dp": -1}), dtypes={"id": "int33"})
    raised.append(error.value)

    def as_the_controller_gets_it(error):
        def loop():
            raise error

        try:
            marking_repeated_errors(loop)()
        except BaseException as exc:  # noqa: BLE001
            return pickle.loads(pickle.dumps(exc))

    for error in raised:
        policy = RetriesSkipRepeatedErrors(FailureConfig(max_failures=-1))
        failed = WorkerGroupError("failed", {0: as_the_controller_gets_it(error)})
        assert policy.make_decision(failed) == FailureDecision.RAISE, error


def test_numbers_written_as_text_convert_with_dtypes_and_casts_to_bool_are_checked(ray_cluster):
    """Ray Data hands a string column over as objects, which were refused as text before a dtypes entry could
    convert them (as the README says they do); without one, the error now points to it. A cast to bool made every
    value but 0 True: ids 0..7 became one False and seven Trues, 0.5 True, silently."""
    import ray.data

    mesh = rjt.make_mesh({"dp": -1})
    rows = ray.data.from_items([{"id": i, "num": str(i * 1.5), "half": i / 2, "flag": i % 2} for i in range(8)])

    def first(**kwargs):
        return {k: np.asarray(v) for k, v in next(iter(rjt.iter_jax_batches(rows, batch_size=4, mesh=mesh,
                                                                            **kwargs))).items()}

    batch = first(columns=["num", "flag"], dtypes={"num": np.float32, "flag": bool})
    assert batch["num"].dtype == np.float32 and batch["num"].tolist() == [0.0, 1.5, 3.0, 4.5]
    assert batch["flag"].tolist() == [False, True, False, True]
    with pytest.raises(TypeError, match=r"Column 'num' holds numbers written as text.*dtypes=\{'num': 'float32'\}"):
        first(columns=["num"])
    with pytest.raises(ValueError, match=r"casts column 'id' from int64 to bool, but it holds values other than 0 "
                                         r"and 1 \(2, 3, 4, 5, \.\.\.\)"):
        first(columns=["id"], dtypes={"id": bool})
    with pytest.raises(ValueError, match=r"casts column 'half' from float64 to bool.*other than 0 and 1 \(0.5, 1.5"):
        first(columns=["half"], dtypes={"half": bool})
    texts = ray.data.from_items([{"word": w} for w in ("a", "b", "c", "d")])
    with pytest.raises(TypeError, match="Column 'word' holds text.*Tokenise it"):
        next(iter(rjt.iter_jax_batches(texts, batch_size=4, mesh=mesh, dtypes={"word": np.float32})))


_HANGS_AT_EXIT = r'''
import ctypes, sys
from ray_jax_train.trainer import exit_within_a_deadline

libc = ctypes.CDLL(None)
if sys.argv[1] == "hang":
    # A C exit handler that never returns, as Ray 2.60's core worker destructor deadlocked in a controller's exit.
    libc.__cxa_atexit(ctypes.cast(libc.pause, ctypes.c_void_p), None, None)
exit_within_a_deadline()
sys.exit(3)
'''


def test_a_process_whose_exit_hangs_in_c_exit_handlers_still_ends(tmp_path):
    """A ray::TrainController outlived its driver and its cluster after test suites: its exit deadlocked in Ray's
    C++ core worker destructor (gdb: `post_immediate_completion` under `__run_exit_handlers`), after Python was
    done, and its raylet-death check had stopped with the io_context. The controller's exit now has a deadline."""
    import signal
    import subprocess
    import time

    script = tmp_path / "exits.py"
    script.write_text(_HANGS_AT_EXIT)
    env = dict(os.environ, RAY_JAX_TRAIN_EXIT_DEADLINE_S="1")
    started = time.time()
    hung = subprocess.run([sys.executable, str(script), "hang"], env=env, capture_output=True, timeout=60)
    assert hung.returncode == -signal.SIGALRM, (hung.returncode, hung.stderr[-2000:])
    assert time.time() - started < 30
    # A normal exit keeps its own status. Its deadline is the default's: a 1 s one rang (-14) on a loaded CI machine
    # while Python's own atexit handlers (Ray's among them) were still running, which is a slow exit, not a hang.
    env_clean = dict(os.environ, RAY_JAX_TRAIN_EXIT_DEADLINE_S="20")
    clean = subprocess.run([sys.executable, str(script), "clean"], env=env_clean, capture_output=True, timeout=60)
    assert clean.returncode == 3, (clean.returncode, clean.stderr[-2000:])
    from ray_jax_train import JaxTrainer
    from ray_jax_train.trainer import ExitsEvenIfRayHangsAtExit

    assert any(isinstance(c, ExitsEvenIfRayHangsAtExit)
               for c in JaxTrainer(lambda: None)._create_default_callbacks())
