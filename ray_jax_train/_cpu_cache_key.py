"""Let every process of a multi-process CPU job read the compilation cache that process 0 writes.

JAX writes persistent-cache entries from process 0 only, and keys them with a fingerprint of the devices'
topology. On CPU that fingerprint differs from process to process (JAX 0.10: the same 2 devices give one
value in process 0 and another in process 1), so no other process ever finds an entry: after a restart,
process 0 loads its programs while the others compile all of them, and the group waits for the slowest.

The program a process would look up is the same SPMD program process 0 compiled (JAX's own
`share_binary_between_hosts` hands process 0's executable to the others in the same way). So for CPU jobs
the fingerprint is replaced by what does identify the target: each device's platform, kind, id and process,
plus the host CPU's model and instruction-set flags, so hosts of another CPU type never load code built
for this one. Accelerators keep JAX's own fingerprint.
"""
from __future__ import annotations

import functools
import logging
import platform

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _host_cpu() -> str:
    """The CPU model and feature flags (what XLA:CPU code generation targets)."""
    found = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags", "Features", "CPU implementer", "CPU part") and key not in found:
                    found[key] = " ".join(sorted(value.split()))
    except OSError:
        pass
    return f"{platform.machine()}|{platform.processor()}|" + "|".join(f"{k}={found[k]}" for k in sorted(found))


def share_cpu_cache_entries() -> bool:
    """Key CPU programs so that all processes of the job share process 0's cache entries. True if applied."""
    try:
        from jax._src import cache_key
    except ImportError:
        return False
    original = getattr(cache_key, "_hash_accelerator_config", None)
    if original is None or not hasattr(cache_key, "_hash_string"):
        logger.info("This JAX has no _hash_accelerator_config; CPU processes other than 0 compile on restart.")
        return False
    if getattr(original, "_ray_jax_train", False):
        return True

    def hash_accelerator_config(hash_obj, accelerators) -> None:
        devices = list(accelerators.flat)
        if not devices or any(d.platform != "cpu" for d in devices):
            return original(hash_obj, accelerators)
        cache_key._hash_string(hash_obj, _host_cpu())
        for d in devices:
            cache_key._hash_string(hash_obj, f"{d.platform}:{d.device_kind}:{d.id}:{d.process_index}")

    hash_accelerator_config._ray_jax_train = True
    cache_key._hash_accelerator_config = hash_accelerator_config
    return True
