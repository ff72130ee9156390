"""What the driver can know about a TPU job from its ScalingConfig before any worker starts.

A TPU worker reserves a slice (or several), which takes time and money; a mesh that does not fit the slice, or
workers that split a host's chips, failed only once every worker was up. Ray's ScalingConfig already knows the
topology, the accelerator type and each worker's chips, which is enough to count devices and hosts here.
"""
from __future__ import annotations

from typing import Optional

# Chips whose two TensorCores JAX shows as two devices (no megacore): jax.experimental.pallas.tpu.ChipVersion.
_TWO_DEVICES_PER_CHIP = ("v2", "v3", "v7x")


def tpu_version(scaling_config) -> Optional[str]:
    """"v4", "v6e", ... from `accelerator_type` ("TPU-V6E"); None when it is not set or not one Ray knows."""
    if not getattr(scaling_config, "accelerator_type", None):
        return None
    from ray.util.tpu import get_tpu_version_from_type

    try:
        return get_tpu_version_from_type(scaling_config.accelerator_type)
    except ValueError:
        return None


def chips_per_worker(scaling_config) -> Optional[float]:
    """Physical chips per worker: its "TPU" resources over Ray's resources per chip (RAY_TPU_RESOURCE_PER_CHIP)."""
    try:
        from ray._private.accelerators.tpu import get_tpu_resource_per_chip

        per_chip = get_tpu_resource_per_chip()
    except (ImportError, ValueError):  # Ray's internals moved, or a bad variable Ray itself reports
        return None
    tpus = float(scaling_config.num_tpus_per_worker or 0)
    return tpus / per_chip if tpus > 0 else None


def devices_per_worker(scaling_config) -> Optional[int]:
    """The JAX devices one worker's process will have, or None where the driver cannot tell."""
    version, chips = tpu_version(scaling_config), chips_per_worker(scaling_config)
    if version is None or chips is None or not chips.is_integer():
        return None
    return int(chips) * (2 if version in _TWO_DEVICES_PER_CHIP else 1)


def num_slices(scaling_config) -> Optional[int]:
    """The slices Ray reserves for the workers (its controller's own count), or None without a topology and a TPU
    accelerator_type Ray knows: the unit a multi-slice `dcn_mesh` counts."""
    workers, topology = scaling_config.num_workers, getattr(scaling_config, "topology", None)
    if not isinstance(workers, int) or workers < 1 or not topology or tpu_version(scaling_config) is None:
        return None
    from ray.util.tpu import get_tpu_num_slices_for_workers

    return get_tpu_num_slices_for_workers(topology=topology, accelerator_type=scaling_config.accelerator_type,
                                          num_workers=workers, resources_per_worker=scaling_config.resources_per_worker)


def host_share_problem(scaling_config, distributed: bool) -> Optional[str]:
    """Why several workers would share a TPU host, or None. One jax.distributed process per TPU host owns all of
    the host's chips; processes given a part of a host each start libtpu as a single-host slice of their own (Ray
    sets only TPU_VISIBLE_CHIPS and single-host bounds for them) and cannot form one job."""
    workers, topology = scaling_config.num_workers, getattr(scaling_config, "topology", None)
    version, chips = tpu_version(scaling_config), chips_per_worker(scaling_config)
    if not distributed or not isinstance(workers, int) or workers < 2 or not topology or version is None \
            or chips is None:
        return None
    from ray._private.accelerators.tpu import get_chips_per_host, get_num_chips_from_topology

    try:
        per_host, per_slice = get_chips_per_host(topology, version), get_num_chips_from_topology(topology)
    except ValueError:
        return None
    if chips >= per_host:
        return None
    hosts = max(1, per_slice // per_host)
    return (f"resources_per_worker={scaling_config.resources_per_worker} gives each of the {workers} workers "
            f"{chips:g} of a TPU host's {per_host} chips (topology {topology}, {version}), but a multi-process JAX "
            "job runs one process per host, owning all of its chips: processes that split a host start as separate "
            f"slices and cannot form one job. Leave 'TPU' out of resources_per_worker (Ray then gives each worker a "
            f"whole host) with num_workers={hosts} per slice ({hosts} host{'s' * (hosts > 1)} in {topology}), or "
            "run one worker.")
