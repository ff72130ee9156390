"""JaxConfig and the Ray Train backend that turns N Ray workers into one `jax.distributed` job.

Ray's own `ray.train.v2.jax.JaxConfig` skips CPU entirely and pins every GPU worker to GPU 0. This backend
initialises `jax.distributed` on every platform, gives each GPU worker exactly the GPUs Ray assigned it, and
pushes JAX/XLA settings into the worker before its JAX backend starts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import numbers
import os
import re
import shlex
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import ray
from ray.train._internal.utils import get_address_and_port
from ray.train.backend import Backend, BackendConfig

from ray_jax_train.allocator import check_worker_allocator

logger = logging.getLogger(__name__)

PLATFORMS = ("cpu", "gpu", "tpu")
# JAX names the GPU platform "cuda"; users and Ray say "gpu".
_JAX_PLATFORM_NAME = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}
_PLATFORM_FROM_JAX = {"cpu": "cpu", "cuda": "gpu", "gpu": "gpu", "rocm": "gpu", "tpu": "tpu"}
_MULTISLICE_KEYS = ("MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID")


@contextlib.contextmanager
def _loop_context():
    """Around each worker's training function: its end is recorded, so that a process left waiting at a checkpoint
    exchange for it fails at once, naming it, instead of at the exchange's timeout (a rank-0-only save)."""
    from ray_jax_train.checkpoint._sync import mark_loop_done

    _prints_shown_once()
    try:
        yield
    except BaseException:
        mark_loop_done("raised")  # the others keep waiting: Ray ends the group with this worker's own error
        raise
    mark_loop_done("returned")


def _prints_shown_once() -> None:
    """A print() in the loop shows once on the driver, not twice.

    Ray 2.60's Train sends a worker's print to its logger, whose console handler shows it, and to the stream too
    where that is not the process's own (`sys.stdout is not sys.__stdout__`: a redirect_stdout of the loop's,
    which should get its copy). But Ray's worker puts unbuffered wrappers of the same file descriptors in
    sys.stdout and sys.stderr, so every print in every loop showed twice. Those wrappers are the process's own
    streams; a redirect the loop makes is still one.
    """
    try:
        from ray._private.utils import Unbuffered
    except ImportError:  # pragma: no cover - a Ray that moved it: prints may show twice, nothing breaks
        return
    for name in ("stdout", "stderr"):
        stream, own = getattr(sys, name), getattr(sys, f"__{name}__")
        try:
            same_file = own is not None and stream.fileno() == own.fileno()
        except (AttributeError, OSError, ValueError):  # a stream without a descriptor: not Ray's wrapper
            continue
        if type(stream) is Unbuffered and same_file:
            setattr(sys, f"__{name}__", stream)


@dataclasses.dataclass
class JaxConfig(BackendConfig):
    """How each worker's JAX runtime is set up.

    Args:
        use_tpu / use_gpu: as in Ray's `JaxConfig`; they also follow `ScalingConfig` when left False.
        platform: "cpu", "gpu" or "tpu"; overrides the choice made from the scaling config and `JAX_PLATFORMS`.
        num_cpu_devices: CPU devices per worker process, so multi-device meshes can be tested on CPU. None (the
            default): the count the workers' environment sets by hand (`--xla_force_host_platform_device_count` in
            XLA_FLAGS, `JAX_NUM_CPU_DEVICES`; Ray's way), else 1. A number here wins over those.
        mesh: ordered axis name -> size (one size may be -1) that `ray_jax_train.get_mesh()` builds in the loop.
        dcn_mesh: for multi-slice TPU (or hosts as the slow network), how many slices each `mesh` axis spans,
            e.g. {"dp": 2}; `mesh` sizes stay the totals. `get_mesh()` then builds a hybrid ICI x DCN mesh.
        env_vars: extra `JAX_*` / `XLA_*` environment for the workers, set before JAX starts there.
        xla_flags: appended to the workers' `XLA_FLAGS`. On TPU the TPU compiler's and runtime's own flags
            (`--xla_tpu_*`, `--xla_jf_*`, `--xla_sc_*`, `--megascale_*`) go to `LIBTPU_INIT_ARGS` instead: libtpu
            reads them there, and JAX exits on flags in `XLA_FLAGS` it does not know. Other libtpu flags:
            `env_vars={"LIBTPU_INIT_ARGS": "..."}`.
        gpu_memory_preallocate / gpu_memory_fraction: JAX's GPU allocator settings, e.g. to share a GPU
            between Tune trials.
        compilation_cache: keep JAX's persistent compilation cache (on by default), so a restart after a failure
            loads its compiled programs instead of compiling them again.
        compilation_cache_dir: where that cache lives; None puts it in the run's storage directory,
            `<storage_path>/<name>/compilation_cache`, when that is a local or mounted filesystem.
        cpu_affinity: pin each CPU worker to its own cores (local rank x CPUs per worker). Workers on one node
            get distinct physical cores where it has them: two hyperthreads of one core run far slower than two
            cores. XLA's CPU thread pool sizes itself from the affinity mask, so without pinning N workers on one
            node oversubscribe it.
            Opt-in: two trainers sharing a node (e.g. Tune trials) would pin onto the same cores.
        keep_cpu_memory: CPU workers start with glibc's allocator set to keep the memory XLA frees
            (`GLIBC_TUNABLES`: one arena, no mmap, no trimming). XLA:CPU allocates each step's temporaries as one
            block (312 MB for the benchmark model); by default glibc maps it fresh every step and the kernel
            zero-fills every page again, 15-20% of a step. Kept, the block is reused: 1.28x tokens/s on that model.
            The costs: the process keeps the most memory it ever held (checkpoint and eval buffers included)
            and never returns it to the OS, and all threads share one allocator lock. Measured on a 2-core VM
            only; False gives glibc's defaults back. Skipped where `GLIBC_TUNABLES` is already set (the
            driver's environment or `RunConfig(worker_runtime_env=...)`). Each worker checks that its allocator
            honours the settings and logs a warning naming the cause where it does not (another malloc
            preloaded, a glibc that ignores them).
        initialization_timeout_s / heartbeat_timeout_s / shutdown_timeout_s: `jax.distributed` timeouts;
            shutdown_timeout_s=None takes `JAX_DISTRIBUTED_SHUTDOWN_TIMEOUT_S` from the driver (as Ray does), else 60.
        distributed: False leaves `jax.distributed` alone: each worker is its own JAX process (as Ray's
            JaxTrainer on CPU), for loops that call `jax.distributed.initialize` themselves or want independent
            workers. The other settings still apply; `get_mesh()` then spans the worker's own devices.
    """

    use_tpu: bool = False
    use_gpu: bool = False
    platform: Optional[str] = None
    num_cpu_devices: Optional[int] = None
    mesh: Optional[Mapping[str, int]] = None
    dcn_mesh: Optional[Mapping[str, int]] = None
    env_vars: Dict[str, str] = dataclasses.field(default_factory=dict)
    xla_flags: Sequence[str] = ()
    gpu_memory_preallocate: Optional[bool] = None
    gpu_memory_fraction: Optional[float] = None
    compilation_cache: bool = True
    compilation_cache_dir: Optional[str] = None
    cpu_affinity: bool = False
    keep_cpu_memory: bool = True
    initialization_timeout_s: int = 300
    heartbeat_timeout_s: int = 100
    shutdown_timeout_s: Optional[int] = None
    distributed: bool = True

    def __post_init__(self):
        # Kinds a typo or a config file gets wrong: "false" read as True joined workers that were meant apart, and a
        # list of env vars failed as "'list' object has no attribute 'items'" (a Python API review).
        def flag(value) -> bool:  # numpy's bools, and 0 / 1 (Ray's own JaxConfig takes anything), are flags too
            return isinstance(value, (bool, np.bool_)) or (isinstance(value, numbers.Integral) and value in (0, 1))

        def number(value) -> bool:
            return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))

        for name in ("use_tpu", "use_gpu", "compilation_cache", "cpu_affinity", "keep_cpu_memory", "distributed"):
            if not flag(getattr(self, name)):
                raise TypeError(f"JaxConfig({name}={getattr(self, name)!r}) must be True or False.")
            setattr(self, name, bool(getattr(self, name)))
        if self.gpu_memory_preallocate is not None:
            if not flag(self.gpu_memory_preallocate):
                raise TypeError(f"JaxConfig(gpu_memory_preallocate={self.gpu_memory_preallocate!r}) must be True, "
                                "False or None.")
            self.gpu_memory_preallocate = bool(self.gpu_memory_preallocate)
        for name in ("initialization_timeout_s", "heartbeat_timeout_s", "shutdown_timeout_s"):
            value = getattr(self, name)
            if value is None and name == "shutdown_timeout_s":
                continue
            if not number(value) or value <= 0:
                raise ValueError(f"JaxConfig({name}={value!r}) must be a number of seconds > 0.")
        if not isinstance(self.env_vars, Mapping):
            raise TypeError(f"JaxConfig(env_vars=...) must be a dict of name -> value, got a "
                            f"{type(self.env_vars).__name__}; e.g. env_vars={{'XLA_PYTHON_CLIENT_PREALLOCATE': 'false'}}")
        if self.gpu_memory_fraction is not None and not number(self.gpu_memory_fraction):
            raise TypeError(f"JaxConfig(gpu_memory_fraction={self.gpu_memory_fraction!r}) must be a number in (0, 1].")
        if self.platform is not None:
            self.platform = str(self.platform).lower()
            if self.platform == "cuda":
                self.platform = "gpu"
            if self.platform not in PLATFORMS:
                raise ValueError(
                    f"JaxConfig(platform={self.platform!r}) is not a platform; use one of {PLATFORMS} "
                    "or leave it None to follow ScalingConfig(use_gpu/use_tpu) and JAX_PLATFORMS."
                )
        if self.num_cpu_devices is not None and (not isinstance(self.num_cpu_devices, int)
                                                 or isinstance(self.num_cpu_devices, bool) or self.num_cpu_devices < 1):
            raise ValueError(
                f"JaxConfig(num_cpu_devices={self.num_cpu_devices!r}) must be an integer >= 1 (or None): it is the "
                "number of CPU devices each worker process exposes to JAX."
            )
        if self.gpu_memory_fraction is not None and not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(
                f"JaxConfig(gpu_memory_fraction={self.gpu_memory_fraction}) must be in (0, 1]: it is the share of "
                "each GPU's memory that JAX may use."
            )
        bad_env = [k for k in self.env_vars if not isinstance(k, str)]
        if bad_env:
            raise ValueError(f"JaxConfig(env_vars=...) keys must be strings, got {bad_env}.")
        self.env_vars = {k: _env_value(k, v) for k, v in self.env_vars.items()}
        self.xla_flags = _xla_flag_list(self.xla_flags)
        if "GLIBC_TUNABLES" in self.env_vars:
            raise ValueError(
                "JaxConfig(env_vars={'GLIBC_TUNABLES': ...}) would come too late: glibc reads it when the worker "
                "process starts, and env_vars are set when JAX starts. Put it in "
                "RunConfig(worker_runtime_env={'env_vars': {'GLIBC_TUNABLES': ...}}).")
        if self.mesh is not None:
            from ray_jax_train.mesh import validate_axes

            self.mesh = validate_axes(self.mesh)
        if self.dcn_mesh is not None:
            from ray_jax_train.mesh import validate_axes

            self.dcn_mesh = validate_axes(self.dcn_mesh)
            unknown = [name for name in self.dcn_mesh if name not in (self.mesh or {})]
            if unknown:
                raise ValueError(
                    f"JaxConfig(dcn_mesh={self.dcn_mesh}) names axes {unknown} that are not in mesh={self.mesh}; "
                    "dcn_mesh says how many slices each mesh axis spans, so give the mesh those axes."
                )

    @property
    def backend_cls(self):
        return _JaxBackend

    @property
    def train_func_context(self):
        return _loop_context

    @property
    def framework(self):
        from ray.train.v2._internal.util import TrainingFramework

        return TrainingFramework.JAX

    def to_dict(self) -> Dict[str, Any]:
        return {
            "use_tpu": self.use_tpu,
            "use_gpu": self.use_gpu,
            "platform": self.platform,
            "num_cpu_devices": self.num_cpu_devices,
            "distributed": self.distributed,
        }

    def worker_env(self, environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
        """The environment each worker gets before JAX starts, derived from this config.

        `environ` is the worker's own environment: a `JAX_PLATFORMS` there (runtime_env, or inherited) is kept
        when it agrees with the platform, e.g. "cuda,cpu" so that `jax.devices("cpu")` still works.
        """
        env = dict(self.env_vars)
        platform = self.platform or "cpu"
        env["JAX_PLATFORMS"] = _JAX_PLATFORM_NAME[platform]
        for source, value in (("JaxConfig(env_vars=...)", self.env_vars.get("JAX_PLATFORMS")),
                              ("the worker's environment", (environ or {}).get("JAX_PLATFORMS"))):
            if value and value.strip():
                if _leads_with(value, platform):
                    env["JAX_PLATFORMS"] = value.strip()
                elif environ is not None:
                    # The raylet's environment (e.g. a driver that keeps itself on CPU) is not this run's choice;
                    # values the driver sees are checked there (resolve_jax_config) and never get here.
                    logger.info("JAX_PLATFORMS=%r from %s does not lead with the run's platform %r; using %r.",
                                value, source, platform, env["JAX_PLATFORMS"])
                break
        # The worker's own XLA_FLAGS (a runtime_env's, or inherited) stay, before env_vars' (a later flag wins):
        # env_vars replaced them, so a device count set there was dropped while the driver had counted it.
        own_flags = str((environ if environ is not None else os.environ).get("XLA_FLAGS", "")).strip()
        if "XLA_FLAGS" in env and own_flags and own_flags not in env["XLA_FLAGS"]:
            env["XLA_FLAGS"] = f"{own_flags} {env['XLA_FLAGS']}".strip()
        flags = list(self.xla_flags)
        if platform == "tpu":
            libtpu = [flag for flag in flags if flag.startswith(_LIBTPU_FLAG_PREFIXES)]
            flags = [flag for flag in flags if flag not in libtpu]
            if libtpu:  # after what is there: JAX adds a launch-barrier flag there when it is imported on a TPU VM
                env["LIBTPU_INIT_ARGS"] = " ".join(
                    [env.get("LIBTPU_INIT_ARGS", os.environ.get("LIBTPU_INIT_ARGS", ""))] + libtpu).strip()
        if flags:
            env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", own_flags)] + flags).strip()
        if self.gpu_memory_preallocate is not None:
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true" if self.gpu_memory_preallocate else "false"
        if self.gpu_memory_fraction is not None:
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{self.gpu_memory_fraction:.4f}"
        if self.compilation_cache and self.compilation_cache_dir:
            env["JAX_COMPILATION_CACHE_DIR"] = self.compilation_cache_dir
        return env


# Flags of libtpu (the TPU compiler and runtime), which reads LIBTPU_INIT_ARGS; XLA_FLAGS is parsed by jaxlib.
_LIBTPU_FLAG_PREFIXES = ("--xla_tpu_", "--xla_jf_", "--xla_sc_", "--megascale_")


def _env_value(key: str, value: Any) -> str:
    """An environment variable's value as the worker's os.environ needs it (a bool or number there was a TypeError
    in every worker's set-up, after the driver had accepted it)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int, float)):
        return str(value)
    raise ValueError(f"JaxConfig(env_vars={{{key!r}: {value!r}}}): environment values are strings (or a bool or "
                     f"number, written as one); got a {type(value).__name__}.")


def _xla_flag_list(flags: Any) -> List[str]:
    """XLA flags as a list. One string is taken as a command line (`"--a=1 --b"`): iterated, it was a list of
    characters, which XLA aborted every worker on while Ray went on retrying the worker group (a hang)."""
    if isinstance(flags, str):
        flags = shlex.split(flags)
    try:
        flags = list(flags)
    except TypeError:
        raise TypeError(f"JaxConfig(xla_flags={flags!r}) takes a list of XLA flags (or one string of them), such as "
                        "['--xla_cpu_enable_fast_math=false'].") from None
    bad = [f for f in flags if not isinstance(f, str) or not f.startswith("--")]
    if bad:
        raise ValueError(f"JaxConfig(xla_flags=...) takes XLA flags such as '--xla_cpu_enable_fast_math=false'; "
                         f"{bad} are not flags (each starts with '--').")
    return flags


def _leads_with(jax_platforms: str, platform: str) -> bool:
    """Whether a `JAX_PLATFORMS` value makes `platform` JAX's default backend (JAX gives the first entry priority)."""
    first = jax_platforms.split(",")[0].strip().lower()
    return _PLATFORM_FROM_JAX.get(first) == platform


def _runtime_env_vars(run_config) -> Dict[str, str]:
    """The env_vars of `RunConfig(worker_runtime_env=...)`: how Ray's own trainers configure their workers."""
    worker_env = getattr(run_config, "worker_runtime_env", None) if run_config is not None else None
    return (worker_env.get("env_vars") or {}) if isinstance(worker_env, dict) else {}


def _user_jax_platforms(config: JaxConfig, run_config) -> List[tuple]:
    """(where, value) of the `JAX_PLATFORMS` values the driver knows the workers will get, in precedence order."""
    found = [("JaxConfig(env_vars=...)", config.env_vars.get("JAX_PLATFORMS")),
             ("RunConfig(worker_runtime_env=...)", _runtime_env_vars(run_config).get("JAX_PLATFORMS"))]
    return [(where, value.strip()) for where, value in found if value and value.strip()]


def _usable_cores() -> List[Tuple[int, Tuple[int, int]]]:
    """This node's usable logical CPUs, each with the physical core it runs on (its SMT siblings share that)."""
    cores = []
    for cpu in sorted(os.sched_getaffinity(0)):
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topology}/physical_package_id") as package, open(f"{topology}/core_id") as core:
                physical = (int(package.read()), int(core.read()))
        except (OSError, ValueError):
            physical = (-1, cpu)  # no sysfs topology (some containers): each CPU counts as a core of its own
        cores.append((cpu, physical))
    return cores


def sibling_groups(cores: Sequence[Tuple[int, Tuple[int, int]]]) -> List[List[int]]:
    """The logical CPUs of each physical core (its hyperthreads), ordered by each core's lowest CPU number."""
    siblings: Dict[Tuple[int, int], List[int]] = {}
    for cpu, physical in cores:
        siblings.setdefault(physical, []).append(cpu)
    return sorted(siblings.values())


def plan_node_cores(cores: Sequence[Tuple[int, Tuple[int, int]]], workers: int, per_worker: int
                    ) -> List[Optional[List[int]]]:
    """The logical CPUs each of a node's workers (by local rank) is pinned to; None where the node runs short.

    Hyperthreads of one core share its execution units: two workers pinned to siblings run at far less than
    twice one. So where the node has a physical core per CPU asked for, each worker takes one thread of distinct
    cores; where it has fewer, each takes whole cores (its own siblings), and only if even that runs short do
    workers share a core."""
    groups = sibling_groups(cores)
    if workers * per_worker <= len(groups):
        depth = max(len(g) for g in groups)
        spread = [g[i] for i in range(depth) for g in groups if i < len(g)]
        return [spread[r * per_worker:(r + 1) * per_worker] for r in range(workers)]
    plan, left = [], list(groups)
    for _ in range(workers):
        mine: List[int] = []
        while left and len(mine) < per_worker:
            mine += left.pop(0)
        if len(mine) < per_worker:
            break
        plan.append(mine[:per_worker])
    if len(plan) == workers:
        return plan
    flat = [cpu for g in groups for cpu in g]
    chunks = [flat[r * per_worker:(r + 1) * per_worker] for r in range(workers)]
    return [c if len(c) == per_worker else None for c in chunks]


def resolve_jax_config(jax_config: Optional[JaxConfig], scaling_config, run_config=None) -> JaxConfig:
    """Decide the platform on the driver, before workers start, and check it against the scaling config."""
    config = dataclasses.replace(jax_config) if jax_config is not None else JaxConfig()
    config.use_tpu = bool(config.use_tpu or scaling_config.use_tpu)
    config.use_gpu = bool(config.use_gpu or scaling_config.use_gpu)
    asked_by = "JaxConfig(platform=...)"
    if config.platform is None:
        if config.use_tpu:
            config.platform = "tpu"
        elif config.use_gpu:
            config.platform = "gpu"
        else:
            config.platform = _platform_from_env(config, run_config) or "cpu"
            asked_by = _jax_platforms_source(config, run_config) or asked_by
    fix_env = (" (in a CLI config: scaling.use_gpu: true, or --set scaling.use_gpu=true), or JAX_PLATFORMS=cpu"
               if asked_by.startswith("JAX_PLATFORMS") else ", or platform='cpu'")
    if config.platform == "gpu" and not _requests_gpus(scaling_config):
        raise ValueError(
            f"{asked_by} asks for GPU workers (platform 'gpu', or 'cuda', its other name), but the ScalingConfig gives "
            "the workers no GPU, so JAX would find none. Use ScalingConfig(use_gpu=True) (with "
            f"resources_per_worker={{'GPU': n}} for n per worker){fix_env}."
        )
    if config.platform == "gpu":
        gpus = _gpus_per_worker(scaling_config)
        problem = gpu_share_problem(scaling_config.num_workers, gpus, config.distributed)
        if problem:
            raise ValueError(f"ScalingConfig: {problem}")
        share_gpu_memory(config, gpus)
    cpu_only = [name for name, on in (("num_cpu_devices", (config.num_cpu_devices or 1) > 1),
                                      ("cpu_affinity", config.cpu_affinity)) if on]
    if config.platform != "cpu" and cpu_only:
        logger.warning("JaxConfig(%s) applies to CPU workers only; this run's are %s, so it is ignored.",
                       ", ".join(cpu_only), config.platform.upper())
    if config.platform == "tpu" and not scaling_config.use_tpu:
        raise ValueError(
            f"{asked_by} asks for TPU workers, but ScalingConfig(use_tpu=False): Ray would not schedule the workers "
            "on TPU hosts. Use ScalingConfig(use_tpu=True, topology=..., accelerator_type=...)"
            + (", or JAX_PLATFORMS=cpu." if asked_by.startswith("JAX_PLATFORMS") else ".")
        )
    if config.platform == "tpu":
        from ray_jax_train.tpu import host_share_problem

        problem = host_share_problem(scaling_config, config.distributed)
        if problem:
            raise ValueError(f"ScalingConfig: {problem}")
    for where, value in _user_jax_platforms(config, run_config):
        if not _leads_with(value, config.platform):
            name = _JAX_PLATFORM_NAME[config.platform]
            raise ValueError(
                f"JAX_PLATFORMS={value!r} in {where} contradicts the platform {config.platform!r} this run uses "
                "(JaxConfig(platform=...), ScalingConfig(use_gpu/use_tpu)): JAX in the workers would default to "
                f"{value.split(',')[0].strip()!r}. Remove it, or start it with {name!r} (e.g. '{name},cpu'), or "
                "choose the platform it names."
            )
    if config.shutdown_timeout_s is None:
        # Ray's JaxTrainer honours this variable (its default is 30 s); ours stays 60 s unless it is set.
        from ray._private import ray_constants
        from ray.train.constants import JAX_DISTRIBUTED_SHUTDOWN_TIMEOUT_S

        config.shutdown_timeout_s = ray_constants.env_integer(JAX_DISTRIBUTED_SHUTDOWN_TIMEOUT_S, 60)
    _check_dcn_spans_the_workers(config, scaling_config)  # first: the mesh's blocks below assume it
    devices = _global_device_count(config, scaling_config, run_config)
    if config.mesh is not None and devices is not None:
        from ray_jax_train.mesh import resolve_axes

        who = "the workers" if config.distributed else "each worker (distributed=False)"
        try:
            sizes = resolve_axes(config.mesh, devices)
        except ValueError as exc:
            raise ValueError(f"JaxConfig(mesh=...) does not fit the {devices} devices {who} will have: {exc}")
        dcn = {k: v for k, v in (config.dcn_mesh or {}).items() if v != -1}
        split = {k: (sizes[k], v) for k, v in dcn.items() if k in sizes and sizes[k] % v}
        if split:  # each axis is dcn blocks of equal size: found in every worker once they had started
            raise ValueError(
                f"JaxConfig(mesh={dict(config.mesh)}) over {devices} devices gives "
                f"{', '.join(f'{k}={n}' for k, (n, _) in split.items())}, not divisible by dcn_mesh's "
                f"{', '.join(f'{k}={d}' for k, (_, d) in split.items())}: each axis is dcn_mesh blocks of equal size.")
    return config


def _check_dcn_spans_the_workers(config: JaxConfig, scaling_config) -> None:
    """The slow network's granules are the worker processes on CPU and GPU, and the slices Ray reserves on TPU (from
    the ScalingConfig's topology), both known here: a dcn_mesh of another size failed in every worker once they had
    started, on TPU after the slices were up."""
    workers = scaling_config.num_workers
    if config.dcn_mesh is None or not isinstance(workers, int) or workers < 1:
        return
    known = math.prod(v for v in config.dcn_mesh.values() if v != -1)
    inferred = any(v == -1 for v in config.dcn_mesh.values())
    if not config.distributed:  # each worker's mesh is its own process's devices: one granule
        if known != 1:
            raise ValueError(
                f"JaxConfig(dcn_mesh={dict(config.dcn_mesh)}) spans {known} processes, but with distributed=False "
                "each worker's mesh spans only its own devices (one process): leave dcn_mesh out, or set "
                "distributed=True for one mesh across the workers.")
        return
    if config.platform == "tpu":
        from ray_jax_train.tpu import num_slices

        slices = num_slices(scaling_config)
        if slices is not None and ((slices % known) if inferred else (known != slices)):
            raise ValueError(
                f"JaxConfig(dcn_mesh={dict(config.dcn_mesh)}) spans {known}{' x n' if inferred else ''} slices, but "
                f"the run's {workers} workers on topology {scaling_config.topology} reserve {slices} "
                f"slice{'s' * (slices > 1)} (dcn_mesh counts slices on TPU): make its sizes multiply to {slices}, or "
                "set num_workers to the hosts of as many slices as dcn_mesh spans.")
        return
    if (workers % known) if inferred else (known != workers):
        raise ValueError(
            f"JaxConfig(dcn_mesh={dict(config.dcn_mesh)}) spans {known}{' x n' if inferred else ''} processes, but "
            f"the run has {workers} workers (on {config.platform.upper()} each worker is one process, the unit "
            "dcn_mesh counts): make its sizes multiply to num_workers.")


def _global_device_count(config: JaxConfig, scaling_config, run_config=None) -> Optional[int]:
    """The job's device count where the driver can know it: CPU devices, GPUs or TPU devices per worker, times the
    workers (one worker's with distributed=False). None for elastic worker counts, local mode (num_workers=0), a
    TPU ScalingConfig without accelerator_type (or, for a multi-slice dcn_mesh, without topology), and a CPU count
    only the driver's own environment sets."""
    workers = scaling_config.num_workers
    if not isinstance(workers, int) or workers < 1:
        return None
    if config.dcn_mesh is not None and config.platform == "tpu":
        from ray_jax_train.tpu import num_slices

        if num_slices(scaling_config) is None:  # the slices dcn_mesh splits into are unknown: checked there
            return None
    processes = workers if config.distributed else 1
    if config.platform == "cpu":
        per_worker = _cpu_devices_per_worker(config, run_config)
        return None if per_worker is None else processes * per_worker
    if config.platform == "gpu":
        gpus = _gpus_per_worker(scaling_config)
        return processes * max(1, int(gpus)) if gpus < 1 or gpus.is_integer() else None  # a share is one device
    if config.platform == "tpu":
        from ray_jax_train.tpu import devices_per_worker

        per_worker = devices_per_worker(scaling_config)
        return None if per_worker is None else processes * per_worker
    return None


def _cpu_devices_per_worker(config: JaxConfig, run_config=None) -> Optional[int]:
    """Each worker's CPU device count as the driver sees it: JaxConfig's number, else one set by hand in JaxConfig's
    env_vars/xla_flags or the workers' runtime_env, else 1. None when only the driver's environment sets one: a
    local cluster's workers inherit it, a remote one's do not."""
    if config.num_cpu_devices is not None:
        return config.num_cpu_devices
    worker_env = _runtime_env_vars(run_config)
    ours = {"JAX_NUM_CPU_DEVICES": str(config.env_vars.get("JAX_NUM_CPU_DEVICES", "")),
            "XLA_FLAGS": " ".join([str(worker_env.get("XLA_FLAGS", "")), str(config.env_vars.get("XLA_FLAGS", "")),
                                   *config.xla_flags])}
    for environ in (ours, worker_env):
        count = hand_set_cpu_devices(environ)
        if count is not None:
            return count
    return None if hand_set_cpu_devices(os.environ) is not None else 1


def hand_set_cpu_devices(environ: Mapping[str, str]) -> Optional[int]:
    """The CPU device count an environment sets by hand (`JAX_NUM_CPU_DEVICES`, or XLA's
    `--xla_force_host_platform_device_count` flag, which JAX obeys unless its own setting is given), or None."""
    value = environ.get("JAX_NUM_CPU_DEVICES", "").strip()
    if value.lstrip("-").isdigit() and int(value) > 0:
        return int(value)
    found = re.findall(r"--xla_force_host_platform_device_count=(\d+)", environ.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else None


def gpu_share_problem(num_workers, gpus_per_worker: float, distributed: bool = True) -> Optional[str]:
    """Why Ray or NCCL would refuse this many GPUs per worker, said on the driver; None when they would not."""
    if gpus_per_worker > 1 and not float(gpus_per_worker).is_integer():
        return (f"{gpus_per_worker:g} GPUs per worker: Ray gives a worker either a share of one GPU or a whole "
                "number of GPUs. Use 1, 2, ..., or a share below 1.")
    if gpus_per_worker < 1 and distributed and isinstance(num_workers, int) and num_workers > 1:
        return (f"{gpus_per_worker:g} of a GPU per worker with {num_workers} workers: the workers form one "
                "jax.distributed job, Ray may put two of them on one GPU, and NCCL refuses two processes of one job "
                "on one GPU. Give each worker a whole GPU; a share below 1 is for one-worker runs that share a GPU "
                "(Tune trials).")
    return None


def share_gpu_memory(config: JaxConfig, gpus_per_worker: float) -> JaxConfig:
    """Workers given a share of a GPU: JAX's preallocation off and each process capped at its share, unless set.
    Left alone, the first process takes 75% of the GPU and the next ones fail for memory."""
    if gpus_per_worker < 1:
        if config.gpu_memory_preallocate is None:
            config.gpu_memory_preallocate = False
        if config.gpu_memory_fraction is None:
            config.gpu_memory_fraction = round(0.95 * gpus_per_worker, 4)
        elif config.gpu_memory_fraction > gpus_per_worker:
            logger.warning("gpu_memory_fraction=%g lets each worker take more of the GPU than its share (%g): the "
                           "processes sharing it may run out of memory.", config.gpu_memory_fraction, gpus_per_worker)
    return config


def _gpus_per_worker(scaling_config) -> float:
    return float((scaling_config.resources_per_worker or {}).get("GPU") or 1)


def _requests_gpus(scaling_config) -> bool:
    return bool(scaling_config.use_gpu or (scaling_config.resources_per_worker or {}).get("GPU", 0))


def _platform_from_env(config: JaxConfig, run_config) -> Optional[str]:
    """The platform a user-set JAX_PLATFORMS names: JaxConfig(env_vars), the workers' runtime_env, the driver's."""
    values = [value for _, value in _user_jax_platforms(config, run_config)]
    value = (values or [os.environ.get("JAX_PLATFORMS", "")])[0]
    first = value.split(",")[0].strip().lower()
    return _PLATFORM_FROM_JAX.get(first) if first else None


def _jax_platforms_source(config: JaxConfig, run_config) -> Optional[str]:
    """`JAX_PLATFORMS='cuda' (set in <where>)` for the value that decided the platform, if one did."""
    found = _user_jax_platforms(config, run_config)
    if found:
        where, value = found[0]
    elif os.environ.get("JAX_PLATFORMS", "").strip():
        where, value = "this process's environment: exported, or a job's runtime_env", os.environ["JAX_PLATFORMS"]
    else:
        return None
    return f"JAX_PLATFORMS={value.strip()!r} (set in {where})"


def coordinator_address(ip: str, port: int) -> str:
    """host:port as gRPC reads it: an IPv6 node's address in brackets ("fd00::1:1234" read as a host without a
    port, and jax.distributed.initialize waited out its whole timeout, then aborted the process)."""
    return f"[{ip}]:{port}" if ":" in ip and not ip.startswith("[") else f"{ip}:{port}"


def multislice_env(num_workers: int, num_slices: int, workers_per_slice: int, coordinator_ip: str) -> List[dict]:
    """Per-worker `MEGASCALE_*` variables for multi-slice TPU, from Ray's own TPU utility."""
    if num_slices <= 1:
        return [{} for _ in range(num_workers)]
    from ray.util.tpu import get_tpu_coordinator_env_vars

    return [
        get_tpu_coordinator_env_vars(
            coordinator_address=coordinator_ip,
            num_slices=num_slices,
            slice_id=min(rank // workers_per_slice, num_slices - 1),
        )
        for rank in range(num_workers)
    ]


def assigned_gpus(process_id: int):
    """`CUDA_VISIBLE_DEVICES` and JAX `local_device_ids` for exactly the GPUs Ray gave this worker.

    Ray may hand a worker GPUs 2,3 on an 8-GPU node; expose only those, renumbered from 0 for JAX, so two
    workers on one node never drive the same GPU.
    """
    gpu_ids = [str(i) for i in ray.get_gpu_ids()]
    if not gpu_ids:
        raise RuntimeError(
            f"Worker {process_id} was given no GPU by Ray, but JaxConfig(platform='gpu'). "
            "Set ScalingConfig(use_gpu=True) (with resources_per_worker={'GPU': n} for n per worker)."
        )
    return ",".join(gpu_ids), list(range(len(gpu_ids)))


class DistributedStartError(RuntimeError):
    """`jax.distributed.initialize` failed in a worker: the group is started again (within FailureConfig)."""


def _setup_worker(
    coordinator: str,
    num_processes: int,
    process_id: int,
    config: JaxConfig,
    slice_env: Mapping[str, str],
    cores: Optional[Sequence[int]] = None,
) -> dict:
    """Runs on each worker: environment first, then `jax.distributed.initialize`."""
    if cores:
        os.sched_setaffinity(0, cores)
    env = config.worker_env(os.environ)
    for key, value in env.items():
        os.environ[key] = value
    for key, value in slice_env.items():
        # Always overwrite: a stale value from a replaced slice would make libtpu wait for slices that are gone.
        if key in _MULTISLICE_KEYS or key not in os.environ:
            os.environ[key] = value

    local_device_ids = None
    if config.platform == "gpu":
        visible, local_device_ids = assigned_gpus(process_id)
        os.environ["CUDA_VISIBLE_DEVICES"] = visible

    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "JAX's backend was already started in this worker before ray_jax_train could configure it "
            "(something called into JAX at import time). Move JAX work inside train_loop_per_worker."
        )
    jax.config.update("jax_platforms", env["JAX_PLATFORMS"])
    if config.platform == "cpu":
        check_worker_allocator()
        # A count set by hand (Ray's way: a runtime_env XLA flag) stands unless JaxConfig gives one; set here, as
        # JAX read JAX_NUM_CPU_DEVICES when this process imported it, before env_vars were applied.
        hand_set = hand_set_cpu_devices(os.environ)
        if config.num_cpu_devices is not None and hand_set not in (None, config.num_cpu_devices):
            logger.warning("JaxConfig(num_cpu_devices=%d) overrides the %d CPU devices that XLA_FLAGS or "
                           "JAX_NUM_CPU_DEVICES ask for.", config.num_cpu_devices, hand_set)
        jax.config.update("jax_num_cpu_devices", config.num_cpu_devices or hand_set or 1)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if config.compilation_cache and config.compilation_cache_dir:
        from ray_jax_train._cache_repair import drop_unreadable_entries

        jax.config.update("jax_compilation_cache_dir", config.compilation_cache_dir)
        drop_unreadable_entries()  # a worker killed while writing an entry left it torn for every restart
        if config.platform == "cpu":
            # Small CPU programs compile fast but are still worth caching for restarts. On accelerators JAX's
            # 1 s floor keeps eager ops' programs out of the (often networked) run storage.
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            if num_processes > 1:
                from ray_jax_train._cpu_cache_key import share_cpu_cache_entries

                share_cpu_cache_entries()
    elif not config.compilation_cache:
        # Workers inherit the raylet's environment, where a JAX_COMPILATION_CACHE_DIR would switch it on.
        jax.config.update("jax_enable_compilation_cache", False)
    _count_cache_hits()

    if not config.distributed:
        _state.config = config
        # Ask JAX nothing here: that would start its backend, and the loop's own jax.distributed.initialize
        # must come first.
        return {}
    waited = _wait_for_coordinator(coordinator, config.initialization_timeout_s) if process_id != 0 else 0.0
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=local_device_ids,
            initialization_timeout=max(1, math.ceil(config.initialization_timeout_s - waited)),
            # Whole seconds: jaxlib's service refuses a float (10.5, even 30.0) with a TypeError on every attempt.
            heartbeat_timeout_seconds=max(1, math.ceil(config.heartbeat_timeout_s)),
            shutdown_timeout_seconds=(None if config.shutdown_timeout_s is None
                                      else max(1, math.ceil(config.shutdown_timeout_s))),
        )
    except Exception as exc:
        raise DistributedStartError(f"jax.distributed.initialize failed on process {process_id} of "
                                    f"{num_processes} (coordinator {coordinator}): {exc}") from exc
    _state.config = config
    _answer_a_second_initialize(num_processes, process_id, coordinator)
    if num_processes > 1:
        from ray_jax_train._after_import import call_after_import

        # A directory per worker (Ray's checkpoint guide) is refused, not left to hang; installed when the loop
        # imports orbax, not before (that import was ~0.9 s of every worker's start).
        call_after_import("orbax.checkpoint", _install_orbax_guard)
    try:
        return {
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
            "local_device_count": jax.local_device_count(),
            "device_count": jax.device_count(),
        }
    except Exception as exc:
        if config.platform == "tpu" and not _backend_not_installed(exc):
            # libtpu starts here, not in initialize: a TPU the previous attempt's process still holds, or a slice
            # handshake after a slice was replaced, passes on another try (as a plain error it ended the run).
            held = (" Another process holds the TPU (the previous attempt's worker, still exiting, or a process "
                    "outside Ray on that host)." if "in use" in str(exc).lower() else "")
            raise DistributedStartError(
                f"JAX in worker {process_id} could not start its TPU backend ({type(exc).__name__}: {exc}).{held} "
                "The worker group is started again within FailureConfig(max_failures).") from exc
        if config.platform != "cpu":
            raise RuntimeError(
                f"JAX in worker {process_id} could not start its {config.platform.upper()} backend "
                f"({type(exc).__name__}: {exc}). Is JAX's accelerator support installed where the workers run, "
                "matching their CUDA driver (pip install 'jax[cuda12]' or 'jax[cuda13]'; 'jax[tpu]' on TPU)? "
                "A plain `pip install jax` runs on CPU only.") from exc
        raise


def _install_orbax_guard() -> None:
    from ray_jax_train.checkpoint import orbax_guard

    orbax_guard.install()


def _wait_for_coordinator(coordinator: str, timeout_s: float) -> float:
    """Until process 0's coordination service listens; the seconds waited. A client that connects before it does
    waits out gRPC's 1 s reconnect backoff, and the workers start together, so every multi-process start (restarts
    too) paid ~1 s. Returns at the timeout either way: jax.distributed.initialize then reports what it finds."""
    import socket
    import time

    host, _, port = coordinator.rpartition(":")
    started = time.monotonic()
    deadline = started + max(1.0, min(timeout_s, 60.0))
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            break
        except OSError:
            time.sleep(0.01)
    return time.monotonic() - started


def _backend_not_installed(exc: BaseException) -> bool:
    """Whether JAX found no plugin for the platform (a retry finds none either), not a backend that failed to start."""
    text = str(exc).lower()
    return isinstance(exc, ImportError) or any(sign in text for sign in (
        "unknown backend", "no platforms that are instances of", "failed to open libtpu", "cannot open shared object"))


def _answer_a_second_initialize(num_processes: int, process_id: int, coordinator: str) -> None:
    """Loops written for Ray's JaxTrainer on CPU, which sets nothing up, call `jax.distributed.initialize()`
    themselves; JAX refused that call here ("must be called before any JAX calls"). One that asks for this job, or
    for nothing in particular, is answered as done; one that asks for another job is refused naming the fix. Another
    coordinator address for this same job (a loop computing its own) is only logged: the processes already agree."""
    import inspect

    import jax

    original = jax.distributed.initialize
    if getattr(original, "_ray_jax_train", False):
        return
    signature = inspect.signature(original)

    def initialize(*args, **kwargs):
        if _state.config is None or not jax.distributed.is_initialized():
            return original(*args, **kwargs)
        asked = signature.bind_partial(*args, **kwargs).arguments
        ours = {"num_processes": num_processes, "process_id": process_id}
        other = {k: asked[k] for k in ours if asked.get(k) is not None and asked[k] != ours[k]}
        if other:
            raise RuntimeError(
                f"jax.distributed.initialize({', '.join(f'{k}={v}' for k, v in other.items())}) in a worker that "
                f"ray_jax_train's JaxTrainer has already joined to its job as process {process_id} of "
                f"{num_processes}. Remove the call, or pass JaxConfig(distributed=False) to set up "
                "jax.distributed yourself.")
        address = asked.get("coordinator_address")
        if address is not None and address != coordinator:
            logger.warning("jax.distributed.initialize(coordinator_address=%r) in a worker already joined through "
                           "the JaxTrainer's coordinator %s (process %d of %d): the address is ignored. Remove the "
                           "call, or pass JaxConfig(distributed=False) to set up jax.distributed yourself.",
                           address, coordinator, process_id, num_processes)
            return
        logger.info("jax.distributed is already initialized by the JaxTrainer (process %d of %d); the loop's "
                    "jax.distributed.initialize() call changes nothing.", process_id, num_processes)

    initialize._ray_jax_train = True
    initialize.__doc__ = original.__doc__
    jax.distributed.initialize = initialize


def _sigterm_is_shutdown():
    from ray_jax_train.checkpoint import signals

    signals.deactivate_sigterm_handler()


def _shutdown_worker():
    import jax

    try:
        jax.distributed.shutdown()
    except Exception as exc:  # a dead peer must not stop the rest of the group from tearing down
        logger.warning("jax.distributed.shutdown() failed: %s", exc)
    _state.config = None


class _WorkerState:
    """What the backend set up in this worker process, for the in-loop helpers."""

    config: Optional[JaxConfig] = None
    cache_hits: int = 0
    compile_requests: int = 0
    counting_cache_hits: bool = False


_state = _WorkerState()


def _count_cache_hits() -> None:
    if _state.counting_cache_hits:  # listeners outlive a restart of the group in a reused process
        return
    import jax

    def on_event(event: str, **_):
        if event == "/jax/compilation_cache/cache_hits":
            _state.cache_hits += 1

    def on_duration(event: str, seconds: float, **_):
        # Every program XLA is asked for, loaded from the cache or compiled; JAX's own "cache_misses" event
        # counts cache writes only, which happen on process 0 and above a compile-time floor.
        if event == "/jax/core/compile/backend_compile_duration":
            _state.compile_requests += 1

    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    _state.counting_cache_hits = True


def compilation_cache_hits() -> int:
    """How many programs this worker process loaded from the persistent compilation cache instead of compiling.

    After a restart it tells whether the cache in the run's storage was used (0 outside a JaxTrainer worker).
    """
    return _state.cache_hits


def compilation_cache_misses() -> int:
    """How many programs this worker process compiled because the persistent compilation cache did not have them.

    Next to `compilation_cache_hits`, it tells what a start paid for: a restart, or a Tune trial after the first,
    should compile (almost) nothing. Small programs JAX dispatches op by op count too.
    """
    return max(_state.compile_requests - _state.cache_hits, 0)


def place_compilation_cache(config: JaxConfig, run_config) -> None:
    """Put the persistent compilation cache in the run's storage unless the user chose a place for it.

    The run directory is what a restarted worker group (and a re-run `fit()` of the same run) sees again, so
    their programs load instead of compiling. JAX's own `JAX_COMPILATION_CACHE_DIR`, set on the driver, names a
    cache that every run shares instead (Tune trials, repeated experiments, a test session), as does one in
    `RunConfig(worker_runtime_env={"env_vars": ...})`. JAX writes gs:// caches itself (through etils and
    gcsfs: where TPU runs keep their storage, and their compiles take minutes); other URIs (an S3 endpoint JAX
    would not know) and custom filesystems leave the cache off unless one of those names a directory.
    """
    if not config.compilation_cache or config.compilation_cache_dir:
        return
    shared = _runtime_env_vars(run_config).get("JAX_COMPILATION_CACHE_DIR") or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if shared:  # the workers' own choice first (Ray's way to configure them), then the driver's
        config.compilation_cache_dir = shared
        return
    search = _tune_search_dir()
    if search:  # fit() inside a Tune trial: the trials share the search's cache, as ray_jax_train.tune's do
        config.compilation_cache_dir = os.path.join(search, "compilation_cache")
        return
    storage = str(run_config.storage_path)
    if storage.startswith("file://"):
        storage = storage[len("file://"):]
    from ray_jax_train.storage import etils_reaches, jax_can_cache_in

    # Not for CPU workers, which cache every program however small (a bucket write each).
    if jax_can_cache_in(storage) and run_config.storage_filesystem is None and config.platform not in (None, "cpu"):
        if etils_reaches("gs"):
            config.compilation_cache_dir = f"{storage.rstrip('/')}/{run_config.name}/compilation_cache"
            return
        logger.info("JAX's compilation cache in %s needs the gcsfs package (pip install 'ray-jax-train[gcs]'); "
                    "without it restarts compile again.", storage)
        return
    if run_config.storage_filesystem is not None or "://" in storage:
        logger.info("Run storage %s is not a local path; set JaxConfig(compilation_cache_dir=...) to keep JAX's "
                    "compilation cache for restarts.", storage)
        return
    config.compilation_cache_dir = os.path.join(os.path.abspath(os.path.expanduser(storage)), run_config.name,
                                                "compilation_cache")


def _tune_search_dir() -> Optional[str]:
    """The Tune experiment directory when this process runs a Tune trial and it is a local path, else None.
    Trials of one search compile mostly the same programs; each run's own cache made every trial compile them."""
    try:
        from ray.train._internal.session import get_session

        session = get_session()
        storage = session.storage if session is not None else None
        if storage is None:
            return None
        import pyarrow.fs

        if not isinstance(storage.storage_filesystem, pyarrow.fs.LocalFileSystem):
            return None
        return storage.experiment_fs_path
    except Exception:  # noqa: BLE001 - Ray's internals moved: keep the run's own cache
        return None


def worker_config() -> Optional[JaxConfig]:
    """The JaxConfig this worker was set up with (None outside a JaxTrainer worker)."""
    return _state.config


class _JaxBackend(Backend):
    # Each worker must see only its own GPUs: sharing CUDA_VISIBLE_DEVICES is what lets workers collide.
    share_cuda_visible_devices = False

    def on_start(self, worker_group, backend_config: JaxConfig):
        try:
            self._start(worker_group, backend_config)
        except Exception as exc:
            # Ray builds the group before this callback and tears it down only if building failed: a worker lost
            # here left its placement group held and rank 0 waiting in jax.distributed.initialize, and on a cluster
            # sized for the job the restart waited for those CPUs forever.
            state = getattr(worker_group, "_worker_group_state", None)
            if state is not None:
                state.shutdown()
                worker_group._clear_state()
            cause = getattr(exc, "cause", None)
            if isinstance(cause, DistributedStartError):
                # A coordinator that could not be reached is worth another try under FailureConfig; as a task
                # error it ended the run at once.
                from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError

                raise WorkerGroupStartupFailedError(str(cause)) from exc
            raise

    def _start(self, worker_group, backend_config: JaxConfig):
        coord_ip, coord_port = worker_group.execute_single(0, get_address_and_port)
        num_workers = len(worker_group)
        num_slices, workers_per_slice = 1, num_workers
        if backend_config.platform == "tpu":
            num_slices, workers_per_slice = self._tpu_slices(worker_group)
        slice_envs = multislice_env(num_workers, num_slices, workers_per_slice, coord_ip)
        cores = self._cpu_cores(worker_group, backend_config)
        futures = [
            worker_group.execute_single_async(
                rank, _setup_worker, coordinator_address(coord_ip, coord_port), num_workers, rank, backend_config, slice_envs[rank],
                cores[rank],
            )
            for rank in range(num_workers)
        ]
        infos = ray.get(futures)
        if not backend_config.distributed:
            logger.info("%d independent JAX processes (%s, distributed=False).", num_workers, backend_config.platform)
            return
        counts = {info["process_count"] for info in infos}
        if counts != {num_workers}:
            raise RuntimeError(f"jax.distributed came up with process counts {counts}, expected {num_workers}.")
        logger.info(
            "jax.distributed ready: %d processes, %d devices (%s).",
            num_workers, infos[0]["device_count"], backend_config.platform,
        )

    @staticmethod
    def _cpu_cores(worker_group, config: JaxConfig) -> List[Optional[List[int]]]:
        """Disjoint core sets per worker on each node, when asked for and when the node has enough cores."""
        num_workers = len(worker_group)
        if not config.cpu_affinity or config.platform != "cpu":
            return [None] * num_workers
        per_worker = max(1, int(worker_group.get_resources_per_worker().get("CPU", 1)))
        # The cores each worker may run on, not os.cpu_count(): in a container held to cores 4-7, core 0 is not ours.
        node_cores = worker_group.execute(_usable_cores)
        plan = []
        for worker, usable in zip(worker_group.get_workers(), node_cores):
            context = worker.distributed_context
            plan.append(plan_node_cores(usable, context.local_world_size, per_worker)[context.local_rank])
        if None in plan:
            logger.warning("cpu_affinity: a node has fewer cores than its workers ask for; not pinning there.")
        return plan

    @staticmethod
    def _tpu_slices(worker_group):
        num_slices = 1
        if hasattr(worker_group, "get_worker_group_context"):
            num_slices = worker_group.get_worker_group_context().num_slices
        if num_slices <= 1:
            return 1, len(worker_group)
        from ray.util.tpu import get_tpu_worker_resources

        scaling = worker_group._train_run_context.scaling_config
        workers_per_slice, _ = get_tpu_worker_resources(
            topology=scaling.topology,
            accelerator_type=scaling.accelerator_type,
            resources_per_worker=scaling.resources_per_worker,
            num_slices=1,
        )
        return num_slices, workers_per_slice

    def on_shutdown(self, worker_group, backend_config: JaxConfig):
        # Ray ends the group with SIGTERMs after this: to the checkpointer's handler they are no preemption (the
        # run failed, finished or was stopped), and its "a checkpoint will be saved" notice misled.
        try:
            ray.get(worker_group.execute_async(_sigterm_is_shutdown), timeout=5)
        except Exception:  # noqa: BLE001 - a dead or hung worker: Ray ends it anyway
            pass
        if not backend_config.distributed:  # the loop may own a jax.distributed job of its own; leave it be
            return
        futures = worker_group.execute_async(_shutdown_worker)
        try:
            ray.get(futures, timeout=backend_config.shutdown_timeout_s + 5)
        except ray.exceptions.GetTimeoutError:
            logger.warning("jax.distributed shutdown timed out; a worker may be hung or dead.")
        except ray.exceptions.RayActorError as exc:  # already dead (an abort, Ctrl-C, a lost owner): nothing to end
            logger.debug("jax.distributed shutdown skipped: a worker is gone (%s)", exc)
