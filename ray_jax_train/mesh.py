"""Meshes from named axis sizes, laid out so each process owns a contiguous block of the data axes."""
from __future__ import annotations

import math
import numbers
from typing import Dict, Iterable, Mapping, Optional, Sequence, Tuple, Union

from ray_jax_train.errors import UsageValueError

# Axes that split the batch, in the order a batch dimension is sharded over them.
BATCH_AXES = ("dp", "fsdp", "data")

AxesLike = Union[Mapping[str, int], Sequence[Tuple[str, int]]]


def validate_axes(axes: AxesLike) -> Dict[str, int]:
    """Check axis names and sizes without knowing the device count (driver-side, before workers start)."""
    if hasattr(axes, "axis_names") and hasattr(axes, "axis_dims"):  # config.MeshSpec, EasyDeL's two lists
        axes = list(zip(axes.axis_names, axes.axis_dims))
    shape_hint = "mesh axes are a mapping such as {'dp': -1} or (name, size) pairs such as [('dp', 2), ('tp', 4)]"
    if isinstance(axes, (str, bytes)) or not isinstance(axes, (Mapping, Iterable)):
        raise UsageValueError(f"Mesh axes {axes!r}: {shape_hint}.")
    if isinstance(axes, Mapping):
        items = list(axes.items())
    else:  # pairs: a list, zip(names, sizes), dict.items(), a generator, an array of pairs
        items = [tuple(item) if isinstance(item, Iterable) and not isinstance(item, (str, bytes)) else item
                 for item in axes]
        if any(not isinstance(item, tuple) or len(item) != 2 for item in items):
            raise UsageValueError(f"Mesh axes {items!r}: {shape_hint}.")
    if not items:
        raise UsageValueError("A mesh needs at least one axis, e.g. {'dp': -1}.")
    names = [name for name, _ in items]
    if len(set(names)) != len(names):
        raise UsageValueError(f"Mesh axis names must be unique, got {names}.")
    for i, (name, size) in enumerate(items):
        if not isinstance(name, str) or not name:
            raise UsageValueError(f"Mesh axis names must be non-empty strings, got {name!r}.")
        # numpy integers (from np.prod, a config array) are sizes too; bool is an int to Python but no size.
        if not isinstance(size, numbers.Integral) or isinstance(size, bool):
            raise UsageValueError(f"Mesh axis {name!r} has size {size!r} of type {type(size).__name__}; sizes are "
                                  "integers >= 1, or -1 to infer one.")
        if size < 1 and size != -1:
            raise UsageValueError(f"Mesh axis {name!r} has size {size!r}; sizes are integers >= 1, or -1 to infer one.")
        items[i] = (name, int(size))
    inferred = [name for name, size in items if size == -1]
    if len(inferred) > 1:
        raise UsageValueError(
            f"Mesh axes {inferred} are all -1, but only one size can be inferred from the device count. "
            "Give all but one of them a size."
        )
    return dict(items)


def resolve_axes(axes: AxesLike, num_devices: int) -> Dict[str, int]:
    """Fill in the -1 axis and check the sizes multiply to `num_devices`."""
    axes = validate_axes(axes)
    known = math.prod(size for size in axes.values() if size != -1)
    if -1 in axes.values():
        if num_devices % known:
            raise UsageValueError(
                f"Mesh axes {axes}: the fixed sizes multiply to {known}, which does not divide the "
                f"{num_devices} devices, so the -1 axis cannot be inferred. Choose sizes whose product divides "
                f"{num_devices}."
            )
        return {name: (num_devices // known if size == -1 else size) for name, size in axes.items()}
    if known != num_devices:
        raise UsageValueError(
            f"Mesh axes {axes} multiply to {known} devices, but there are {num_devices}. "
            "Make the sizes multiply to the device count, or set one axis to -1 to infer it."
        )
    return axes


def make_mesh(axes: AxesLike, devices: Optional[Sequence] = None, *, dcn: Optional[AxesLike] = None):
    """A `Mesh` over all global devices (or `devices`) from an ordered mapping of axis name to size.

    Devices are ordered by (process, id) and filled row-major, so the last axes vary fastest: trailing axes
    (e.g. `tp`) stay inside one process, and each process owns a contiguous block of the leading data axes.
    That is what lets every worker feed its own slice of the global batch.
    `dcn` (slices per axis, e.g. {"dp": 2}) builds a multi-slice hybrid mesh instead; see
    `ray_jax_train.sharding.make_hybrid_mesh`.
    """
    import jax

    if dcn:
        from ray_jax_train.sharding import make_hybrid_mesh

        return make_hybrid_mesh(axes, dcn, devices)
    import numpy as np
    from jax.sharding import Mesh

    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_axes(axes, len(devices))
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    if ordered[0].platform == "tpu" and jax.process_count() == 1:
        return _torus_mesh(sizes, ordered)
    grid = np.array(ordered, dtype=object).reshape(tuple(sizes.values()))
    return Mesh(grid, tuple(sizes))


def _torus_mesh(sizes: Dict[str, int], devices):
    """On a single TPU slice the physical torus matters more than process order: `jax.make_mesh` lays it out.

    With Auto axes, like every other mesh here: `jax.make_mesh` defaults to Explicit ones, under which the models'
    sharding constraints and the train step's shardings fail.
    """
    import jax
    from jax.sharding import AxisType

    return jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes),
                         devices=devices)


def batch_axes_of(mesh, batch_axes: Optional[Sequence[str]] = None) -> Tuple[str, ...]:
    """The mesh axes a batch is split over: given ones (checked), else those of `BATCH_AXES` the mesh has."""
    if batch_axes is None:
        found = tuple(name for name in BATCH_AXES if name in mesh.axis_names)
        if not found:
            raise UsageValueError(
                f"The mesh axes {tuple(mesh.axis_names)} include none of the batch axes {BATCH_AXES}. "
                "Name a data axis 'dp', 'fsdp' or 'data', or pass batch_axes=(...) explicitly."
            )
        return found
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    missing = [name for name in batch_axes if name not in mesh.axis_names]
    if missing:
        raise UsageValueError(f"batch_axes {missing} are not axes of the mesh {tuple(mesh.axis_names)}.")
    return batch_axes


def num_batch_shards(mesh, batch_axes: Optional[Sequence[str]] = None) -> int:
    return math.prod(mesh.shape[name] for name in batch_axes_of(mesh, batch_axes))


def get_mesh():
    """In a JaxTrainer worker: the mesh from `JaxConfig(mesh=...)`, or a 1-D `dp` mesh over all devices."""
    from ray_jax_train.backend import worker_config

    import jax

    config = worker_config()
    axes = config.mesh if config is not None and config.mesh else {"dp": -1}
    # distributed=False: the worker is its own job, even if the loop later starts a jax.distributed job of its own.
    devices = jax.local_devices() if config is not None and not config.distributed else None
    return make_mesh(axes, devices, dcn=getattr(config, "dcn_mesh", None))
