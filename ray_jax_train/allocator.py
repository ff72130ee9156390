"""`JaxConfig(keep_cpu_memory=True)`: glibc settings that keep XLA:CPU's per-step temporaries, and a check that
the worker's allocator honours them.

glibc serves blocks over 32 MB with mmap (thread arenas always: their heaps hold 64 MB at most) and unmaps them on
free, so the kernel faults in and zero-fills a step's temporaries again every step. One arena that never maps and
never trims keeps such blocks for the next step. glibc reads `GLIBC_TUNABLES` only when a process starts, so the
settings travel in the workers' runtime env, and a worker can only check afterwards that they took effect.
"""
from __future__ import annotations

import copy
import ctypes
import functools
import logging
import os
import platform
import threading
from typing import Optional

logger = logging.getLogger(__name__)

KEEP_CPU_MEMORY_TUNABLES = ":".join(["glibc.malloc.arena_max=1", "glibc.malloc.mmap_max=0",
                                     f"glibc.malloc.trim_threshold={1 << 50}"])
# Over glibc's largest mmap threshold (32 MB), so glibc's defaults would map it.
_PROBE_BYTES = 64 << 20


def with_worker_allocator(config, run_config):
    """`run_config` with `GLIBC_TUNABLES` for the workers' processes when `config.keep_cpu_memory` applies.

    It must be in the worker's runtime env (the environment the process starts with), not `JaxConfig.env_vars`.
    The caller's RunConfig is not changed.
    """
    if not config.keep_cpu_memory or config.platform != "cpu":
        return run_config
    if "GLIBC_TUNABLES" in os.environ:
        # Workers of a cluster this process starts inherit it; a remote cluster's do not.
        logger.info("keep_cpu_memory: GLIBC_TUNABLES is set on the driver, so the workers' allocator is left to "
                    "it; for a remote cluster set it in RunConfig(worker_runtime_env={'env_vars': ...}).")
        return run_config
    from ray.train.v2.api.config import RunConfig

    run_config = copy.copy(run_config) if run_config is not None else RunConfig()
    runtime_env = dict(run_config.worker_runtime_env or {})
    env_vars = dict(runtime_env.get("env_vars") or {})
    if "GLIBC_TUNABLES" in env_vars:
        return run_config
    env_vars["GLIBC_TUNABLES"] = KEEP_CPU_MEMORY_TUNABLES
    runtime_env["env_vars"] = env_vars
    run_config.worker_runtime_env = runtime_env
    return run_config


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.lru_cache(maxsize=None)
def keep_cpu_memory_problem() -> Optional[str]:
    """Why this process's allocator does not keep big blocks as `KEEP_CPU_MEMORY_TUNABLES` asks; None when it does.

    Asked once per process: from a new thread (as XLA's pool threads allocate) a 64 MB block must come from the
    heap, not a fresh mapping, and be kept there once freed. Costs address space only: the block is not touched.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"this process does not run on glibc ({platform.system()} {platform.libc_ver()[0] or 'libc'})"
    libc = ctypes.CDLL("libc.so.6")
    process_malloc = ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value
    if process_malloc != ctypes.cast(libc.malloc, ctypes.c_void_p).value:
        return (f"malloc in this process is not glibc's (LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}), so "
                f"GLIBC_TUNABLES does not reach the allocator XLA uses")
    if not hasattr(libc, "mallinfo2"):  # glibc < 2.33
        return None
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    seen = {}

    def allocate_and_free():
        before = libc.mallinfo2()
        block = libc.malloc(_PROBE_BYTES)
        seen["mapped"] = libc.mallinfo2().hblkhd - before.hblkhd
        libc.free(block)
        seen["kept"] = libc.mallinfo2().fordblks  # free bytes the arenas hold, the block among them

    thread = threading.Thread(target=allocate_and_free, name="keep_cpu_memory_probe")
    thread.start()
    thread.join()
    if seen["mapped"] >= _PROBE_BYTES // 2 or seen["kept"] < _PROBE_BYTES // 2:
        return (f"glibc did not apply GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES')!r} in this process: a "
                f"{_PROBE_BYTES >> 20} MB block from a thread was {'mapped' if seen['mapped'] else 'returned'} "
                f"({seen['mapped']} bytes mapped, {seen['kept']} kept after free)")
    return None


def check_worker_allocator() -> Optional[str]:
    """In a CPU worker started with `KEEP_CPU_MEMORY_TUNABLES`: warns when they had no effect, and says why."""
    if os.environ.get("GLIBC_TUNABLES") != KEEP_CPU_MEMORY_TUNABLES:
        return None  # off, or the user's own settings
    problem = keep_cpu_memory_problem()
    if problem:
        logger.warning("keep_cpu_memory has no effect in this worker: %s. Each step's temporaries are mapped and "
                       "faulted in afresh (JaxConfig(keep_cpu_memory=False) says so and skips the settings).",
                       problem)
    return problem
