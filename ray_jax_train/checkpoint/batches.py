"""Deterministic, seeded, resumable global batches: the data path for exact resume.

Ray Data's `streaming_split` hands blocks to workers as they ask for them, so which rows a worker sees (and in
which order) changes from run to run, and a resumed run could not replay the same batches. Here no dataset is
split by Ray. Every worker holds the same rows in the same order, and the global batch for step `s` is a pure
function of (seed, s): epoch `e = s // batches_per_epoch` is a permutation drawn from `seed` and `e`, and batch
`s % batches_per_epoch` takes the next `batch_size` rows of it. Each process then builds only the rows its
devices hold. Resuming at step `s` costs nothing (no batches are read to be skipped), and the same global
batches come out whatever the number of workers or the mesh.

Recipe (in the driver):

    trainer = JaxTrainer(loop, datasets={"train": ds},
                         dataset_config=ray.train.DataConfig(
                             datasets_to_split=[],
                             execution_options=ExecutionOptions(preserve_order=True)), ...)

and in the loop: `batches = ResumableBatches("train", batch_size=..., mesh=mesh, seed=...)`, then
`for step, batch in batches.iterate(start_step)`. `preserve_order=True` makes every worker read the rows in
the dataset's own order; alternatively pass `order_by="id"` (a unique column) to sort after reading.

The rows are held in host memory on every worker (what fits: token ids of a pre-tokenised corpus, tabular
data). Larger data needs an index-addressable source; `iter_jax_batches(skip_batches=...)` serves the
non-exact case.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ray_jax_train.data import _prefetched, _select, batch_sharding, check_batch_size
from ray_jax_train.errors import UsageValueError


def _load_columns(data, columns, order_by) -> Dict[str, np.ndarray]:
    if isinstance(data, Mapping):
        out = {k: np.asarray(v) for k, v in data.items()}
    else:
        if isinstance(data, str):
            import ray.train

            data = ray.train.get_dataset_shard(data)
        parts: Dict[str, list] = {}
        for batch in data.iter_batches(batch_size=4096, batch_format="numpy", prefetch_batches=1):
            for key, value in batch.items():
                parts.setdefault(key, []).append(np.asarray(value))
        out = {k: np.concatenate(v) for k, v in parts.items()}
    if not out:
        raise UsageValueError("ResumableBatches got a dataset with no columns or no rows.")
    lengths = {k: len(v) for k, v in out.items()}
    if len(set(lengths.values())) != 1:
        raise UsageValueError(f"Columns have different lengths: {lengths}.")
    if order_by is not None:
        if order_by not in out:
            raise UsageValueError(f"order_by={order_by!r} is not a column; columns are {sorted(out)}.")
        order = np.argsort(out[order_by], kind="stable")
        out = {k: v[order] for k, v in out.items()}
    if columns is not None:
        missing = [c for c in columns if c not in out]
        if missing:
            raise UsageValueError(f"Columns {missing} are not in the dataset; it has {sorted(out)}.")
        out = {c: out[c] for c in columns}
    return out


class ResumableBatches:
    """Global `jax.Array` batches whose order depends only on (seed, step).

    Args:
        data: a dataset name from `JaxTrainer(datasets=...)` that is NOT split (`DataConfig(datasets_to_split=[])`),
            a `ray.data.Dataset` / `DataIterator`, or a mapping of column -> numpy array.
        batch_size: the global batch size; rows that do not fill a last batch of an epoch are dropped.
        mesh / batch_axes: where batches are sharded (as in `iter_jax_batches`).
        seed: the shuffle seed; `shuffle=False` keeps the dataset order in every epoch.
        order_by: sort the rows by this (unique) column after reading, so the base order cannot depend on
            how the dataset was read.

    Constructing it is collective: every worker does, in the same order, and they check that they all hold the
    same rows.
    """

    def __init__(
        self,
        data: Union[str, Any, Mapping[str, np.ndarray]],
        *,
        batch_size: int,
        mesh,
        seed: int = 0,
        shuffle: bool = True,
        batch_axes: Optional[Sequence[str]] = None,
        columns: Optional[Sequence[str]] = None,
        dtypes: Union[None, Any, Mapping[str, Any]] = None,
        order_by: Optional[str] = None,
        prefetch: int = 2,
    ):
        self.batch_size = batch_size
        self.mesh = mesh
        self.seed = int(seed)
        self.shuffle = shuffle
        if not isinstance(prefetch, int) or prefetch < 1:  # 0 would be an unbounded queue, not "no prefetch"
            raise UsageValueError(f"prefetch={prefetch!r} must be a positive integer.")
        self.prefetch = prefetch
        self._epoch_cache: Tuple[int, Optional[np.ndarray]] = (-1, None)
        problem = None
        try:  # a worker's own failure is shared below, so no worker is left waiting in the exchange
            check_batch_size(batch_size, mesh, batch_axes)
            self.sharding = batch_sharding(mesh, batch_axes)
            self.columns = _select(_load_columns(data, columns, order_by), None, dtypes)
            self.num_rows = len(next(iter(self.columns.values())))
            self.batches_per_epoch = self.num_rows // batch_size
            if self.batches_per_epoch == 0:
                raise UsageValueError(f"{self.num_rows} rows are fewer than one global batch of {batch_size}.")
        except ValueError as exc:
            problem = str(exc)
        self._check_same_rows_everywhere(problem)

    def _check_same_rows_everywhere(self, problem: Optional[str]) -> None:
        """Every process must hold the same rows in the same order, or each fills its part of a batch from other
        rows and the order is no longer a function of (seed, step): compared through a fingerprint of the row
        count, the columns and up to 1024 evenly spaced rows. Any process's own problem fails them all."""
        import hashlib
        import json

        from ray_jax_train.checkpoint import _sync

        fingerprint = None
        if problem is None and _sync.process_count() > 1:
            digest = hashlib.sha256(str(self.num_rows).encode())
            sample = np.unique(np.linspace(0, self.num_rows - 1, num=min(self.num_rows, 1024)).astype(np.int64))
            for key, column in sorted(self.columns.items()):
                digest.update(f"{key}:{column.dtype}:{column.shape[1:]}".encode())
                digest.update(np.ascontiguousarray(column[sample]).tobytes())
            fingerprint = [self.num_rows, digest.hexdigest()]
        shared = [json.loads(v) for v in _sync.allgather("resumable_rows", json.dumps([problem, fingerprint]))]
        problems = [f"process {p}: {text}" for p, (text, _) in enumerate(shared) if text]
        if problems:
            raise UsageValueError("ResumableBatches: " + "; ".join(problems))
        if len({tuple(f) for _, f in shared if f}) > 1:
            raise UsageValueError(
                "ResumableBatches: the workers hold different rows (row counts "
                f"{[f[0] for _, f in shared]}, or the same count in another order), so the global batches would not "
                "be a function of (seed, step). Give every worker the whole dataset in one order: "
                "DataConfig(datasets_to_split=[], execution_options=ExecutionOptions(preserve_order=True)), or "
                "order_by=<a unique column>.")

    def position(self, step: int) -> Dict[str, int]:
        """The data position before global batch `step`: what a checkpoint stores as its `data_state`."""
        return {"step": int(step), "epoch": int(step) // self.batches_per_epoch,
                "batch": int(step) % self.batches_per_epoch, "seed": self.seed, "batch_size": self.batch_size,
                "num_rows": self.num_rows, "shuffle": self.shuffle}

    @staticmethod
    def start_step(data_state: Optional[Mapping[str, Any]]) -> int:
        return 0 if not data_state else int(data_state["step"])

    def resume_step(self, data_state: Optional[Mapping[str, Any]]) -> int:
        """The step to resume at from a checkpoint's `data_state`, checked against this data: another seed, batch
        size or row count would place the step elsewhere in the data and silently replay or skip rows."""
        step = self.start_step(data_state)
        here = self.position(step)
        saved = {k: v for k, v in (data_state or {}).items() if k in here}  # older positions hold fewer keys
        if saved != {k: here[k] for k in saved}:
            raise UsageValueError(
                f"The checkpoint's data position {saved} does not match this data at step {step} "
                f"({here}): the seed, batch size, row count or shuffle changed since it was saved. Resume with the "
                "data settings it was saved with.")
        return step

    def _order(self, epoch: int) -> np.ndarray:
        # One read of the cache and a local result: the prefetch thread and the caller may ask for different
        # epochs at once, and re-reading the cache could hand one of them the other's order.
        cached_epoch, cached = self._epoch_cache
        if cached_epoch == epoch:
            return cached
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
        else:
            order = np.arange(self.num_rows)
        self._epoch_cache = (epoch, order)
        return order

    def global_indices(self, step: int) -> np.ndarray:
        """Row indices of global batch `step` (the same on every process)."""
        epoch, batch = divmod(int(step), self.batches_per_epoch)
        return self._order(epoch)[batch * self.batch_size:(batch + 1) * self.batch_size]

    def batch(self, step: int) -> Dict[str, Any]:
        """Global batch `step`, each process filling only the rows its devices hold."""
        import jax

        rows = self.global_indices(step)
        out = {}
        for key, column in self.columns.items():
            shape = (self.batch_size,) + column.shape[1:]

            def fill(index, column=column):
                return column[rows[index[0]]][(slice(None),) + tuple(index[1:])]

            out[key] = jax.make_array_from_callback(shape, self.sharding, fill)
        return out

    def iterate(self, start_step: int = 0, num_steps: Optional[int] = None) -> Iterator[Tuple[int, Dict[str, Any]]]:
        """(step, batch) from `start_step` on (forever, or `num_steps` batches), prefetched on a thread."""
        import itertools

        steps = itertools.count(start_step) if num_steps is None else range(start_step, start_step + num_steps)
        return _prefetched(((s, self.batch(s)) for s in steps), self.prefetch)
