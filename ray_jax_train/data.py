"""Ray Data shard -> global `jax.Array` batches sharded over a mesh's batch axes.

Ray Data does the reading, shuffling and host batching. This module adds what Ray's own `iter_jax_batches`
lacks: a *global* batch size, any mesh (not a fixed 1-D one), host-to-device prefetch, and the same number of
batches on every worker even when shards are uneven, so a collective in the step can never hang.
"""
from __future__ import annotations

import itertools
import json
import logging
import numbers
import queue
import threading
import weakref
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ray_jax_train.mesh import BATCH_AXES, batch_axes_of

logger = logging.getLogger(__name__)

REMAINDERS = ("drop", "pad")
_call_counter = itertools.count()


class DataError(Exception):
    """An error that every attempt would raise again, as it comes from the data or the settings to read it: a column
    of text, nulls, nested records or ragged rows; values that its dtype cannot hold; columns whose dtype or shape
    differ between reads or workers; a `dtypes`, `columns` or other setting that does not fit the data. Raised as a
    `TypeError` or `ValueError` (`DataTypeError`, `DataValueError`), as before."""

    retry_repeats_it = True  # FailureConfig does not retry it (ray_jax_train.retries): each attempt reads the same


class DataTypeError(DataError, TypeError):
    """A column whose kind (text, nulls, nested, ragged) cannot become a jax.Array, or a setting of the wrong type."""


class DataValueError(DataError, ValueError):
    """A column whose values, dtype or layout do not fit, or a setting that does not fit the data or the mesh."""


_warned_whole_dataset = False


def resolve_dataset(dataset) -> Any:
    """A `DataIterator` from a dataset name (this worker's shard), an iterator, or a Ray Dataset."""
    if isinstance(dataset, str):
        import ray.train

        try:
            return ray.train.get_dataset_shard(dataset)
        except (KeyError, AssertionError) as exc:  # AssertionError: in Ray's local mode (num_workers=0)
            given = _given_dataset_names()
            import difflib

            close = difflib.get_close_matches(dataset, given, n=1)
            named = (f"; it was given {given}" + (f" (did you mean {close[0]!r}?)" if close else "")) if given else ""
            raise DataValueError(
                f"No dataset named {dataset!r} was given to the trainer ({exc}){named}. Pass it in "
                f"JaxTrainer(datasets={{{dataset!r}: ...}}) or use one of the names that were passed."
            ) from None
    if hasattr(dataset, "iter_batches"):
        import jax
        import ray.data

        global _warned_whole_dataset
        if isinstance(dataset, ray.data.Dataset) and jax.process_count() > 1 and not _warned_whole_dataset:
            _warned_whole_dataset = True  # once per process: a loop opens one each epoch
            logger.warning(
                "iter_jax_batches got a ray.data.Dataset, which this worker reads whole: unless each worker was "
                "given a different part (ds.split(n)[rank]), each row is fed %d times (once per worker's share of "
                "every global batch). Pass the dataset to the trainer (datasets={'train': ds}) and open "
                "iter_jax_batches('train'): each worker then reads its own shard.", jax.process_count())
        return dataset
    raise DataTypeError(
        f"iter_jax_batches needs a dataset name, a ray.data.DataIterator or a ray.data.Dataset, "
        f"got {type(dataset).__name__}."
    )


def _given_dataset_names() -> list:
    """The trainer's dataset names, for an error about another one; [] where Ray's (private) context does not say."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return sorted(getattr(get_train_context().dataset_shard_provider, "_dataset_names", None) or [])
    except Exception:  # noqa: BLE001 - only an error message's detail
        return []


def _check_split(name: str, iterator) -> None:
    """A trainer dataset left out of `DataConfig(datasets_to_split=...)` is whole on every worker: fed as
    process-local rows, each global batch would hold every row once per process, with no error."""
    import jax

    if jax.process_count() == 1:
        return
    from ray.data._internal.iterator.stream_split_iterator import StreamSplitDataIterator  # private: import late

    if not isinstance(iterator, StreamSplitDataIterator):
        raise DataValueError(
            f"Dataset {name!r} is not split between the workers (DataConfig(datasets_to_split=...) leaves it out), "
            f"so each of the {jax.process_count()} processes would read all of it and every global batch would "
            f"hold each row {jax.process_count()} times. Split it (datasets_to_split='all' or a list naming "
            f"{name!r}), or pass this process's own part as a Dataset or DataIterator.")


def batch_sharding(mesh, batch_axes: Optional[Sequence[str]] = None):
    """Rows split over the batch axes, every other dimension replicated."""
    from jax.sharding import NamedSharding, PartitionSpec

    axes = batch_axes_of(mesh, batch_axes)
    # P("dp") rather than P(("dp",)): the same sharding a user writes by hand, so jit does not recompile.
    return NamedSharding(mesh, PartitionSpec(axes[0] if len(axes) == 1 else axes))


def process_rows(sharding, batch_size: int) -> int:
    """How many rows of a global batch this process feeds, checked to be a clean split across processes."""
    import jax

    rows = set()
    for index in sharding.addressable_devices_indices_map((batch_size,)).values():
        rows.update(range(*index[0].indices(batch_size)))
    per_process = batch_size // jax.process_count()
    if len(rows) == per_process:
        return per_process
    spanning = _axes_spanning_processes(sharding.mesh) if hasattr(sharding, "mesh") else None
    batch_axes = _spec_axes(sharding)
    if spanning and batch_axes and not set(batch_axes) & set(spanning):
        data_axes = [name for name in spanning if name in BATCH_AXES]
        fix = (f"Shard the batch over the data axes that span the processes: batch_axes={tuple(data_axes)!r}, or "
               f"batch_axes={tuple(data_axes) + tuple(batch_axes)!r} to split it over both." if data_axes else
               f"List the data axes first in the mesh (e.g. {{{batch_axes[0]!r}: ..., {spanning[-1]!r}: ...}}): the "
               "trailing axes stay within a process, the leading ones span the processes.")
        raise DataValueError(
            f"The batch axes {batch_axes} lie within each process (all their devices are this process's), so every "
            f"process would hold the whole batch of {batch_size} rows and feed each row {jax.process_count()} "
            f"times; the axes that span the processes are {spanning}. {fix}")
    raise DataValueError(
        f"The mesh's batch axes do not split the batch evenly across the {jax.process_count()} processes "
        f"(this process would hold {len(rows)} of {batch_size} rows). Put the data axes (dp/fsdp) first in the "
        "mesh so that each process owns a distinct block of the batch. If they are first, a later axis (tp, "
        f"sp) spans processes: this process has {jax.local_device_count()} devices, and the product of the "
        "axes after the data axes must divide that (e.g. tp=2 needs 2 devices per worker)."
    )


def _axes_spanning_processes(mesh) -> list:
    """Mesh axes along which this process's devices do not cover every position: the axes that split work
    between processes."""
    import jax

    mine = np.vectorize(lambda d: d.process_index == jax.process_index())(mesh.devices)
    return [name for i, name in enumerate(mesh.axis_names)
            if not np.any(mine, axis=tuple(j for j in range(mine.ndim) if j != i)).all()]


def _spec_axes(sharding) -> tuple:
    spec = getattr(sharding, "spec", None)
    if not spec:
        return ()
    first = spec[0]
    return () if first is None else ((first,) if isinstance(first, str) else tuple(first))


def check_batch_size(batch_size: int, mesh, batch_axes: Optional[Sequence[str]] = None) -> int:
    """Number of batch shards; raises when the global batch does not split over them."""
    import math

    axes = batch_axes_of(mesh, batch_axes)
    shards = math.prod(mesh.shape[name] for name in axes)
    if not isinstance(batch_size, numbers.Integral) or isinstance(batch_size, bool) or batch_size <= 0:
        raise DataValueError(f"Global batch_size={batch_size!r} ({type(batch_size).__name__}) must be a positive "
                             f"integer, a multiple of the {shards} batch shards of mesh axes {axes}.")
    batch_size = int(batch_size)
    if batch_size % shards:
        lower = (batch_size // shards) * shards
        hint = f" (e.g. {lower} or {lower + shards})" if lower else f" (e.g. {shards})"
        raise DataValueError(
            f"Global batch_size={batch_size} is not divisible by the {shards} batch shards of mesh axes "
            f"{axes} (sizes {[mesh.shape[a] for a in axes]}). Use a multiple of {shards}{hint}."
        )
    return shards


def iter_jax_batches(
    dataset: Union[str, Any],
    *,
    batch_size: int,
    mesh,
    batch_axes: Optional[Sequence[str]] = None,
    dtypes: Union[None, Any, Mapping[str, Any]] = None,
    columns: Optional[Sequence[str]] = None,
    remainder: str = "drop",
    mask_key: str = "valid",
    prefetch: int = 2,
    sync: bool = True,
    sync_window: int = 4,
    sync_timeout_s: float = 1800.0,
    skip_batches: int = 0,
    min_read_rows: int = 1024,
    local_shuffle_buffer_size: Optional[int] = None,
    local_shuffle_seed: Optional[int] = None,
) -> Iterator[Dict[str, Any]]:
    """Yield dicts of global `jax.Array`s of `batch_size` rows, sharded over `mesh`'s batch axes.

    Reading starts at once, in a background thread: open the iterator before building and compiling the train
    state, and Ray Data's start-up overlaps with that work instead of delaying the first step.

    Args:
        dataset: a name from `JaxTrainer(datasets=...)` (this worker's shard of it), a `DataIterator`, or a
            `ray.data.Dataset`. An iterator or Dataset given directly is this process's data, read whole: one
            Dataset built identically in every worker puts each row into the global batch once per process.
        batch_size: the GLOBAL batch size; each process reads `batch_size / process_count` rows.
        mesh: the mesh to shard over; `batch_axes` defaults to those of dp, fsdp, data it has.
        dtypes: one dtype for every column or a column -> dtype mapping (e.g. `jnp.bfloat16`).
        columns: columns to keep (default all).
        remainder: "drop" ends at the last batch every worker can fill; "pad" pads the tail with zeros and
            adds a boolean `mask_key` column that marks real rows (so every batch has the same shape).
        prefetch: batches placed on device ahead of the one being consumed.
        sync: agree with the other processes on the batch count (uneven shards); turn off only when the
            shards are known to be equal. With it, opening an iterator is collective: every process opens the
            same iterators in the same order (they are matched by that order).
        skip_batches: global batches to skip first, e.g. those consumed before a resume.
        min_read_rows: rows fetched from Ray Data per read (a multiple of the per-process batch), to amortise
            Ray's per-batch overhead over several steps.
        local_shuffle_buffer_size, local_shuffle_seed: Ray Data's local shuffle of this process's rows. A fixed
            seed gives the same order every epoch: vary it with the epoch (and the process), as the built-in loop
            does with (seed, epoch, worker).
    """
    import jax

    if remainder not in REMAINDERS:
        raise DataValueError(f"remainder={remainder!r}; use one of {REMAINDERS}.")
    if prefetch < 1:
        raise DataValueError(f"prefetch={prefetch} must be >= 1.")
    if not isinstance(sync_window, int) or sync_window < 1:  # 0 would agree on 0 batches forever, never ending
        raise DataValueError(f"sync_window={sync_window!r} must be a positive integer.")
    # 1.5 skipped every batch, -1 none, without a word (a Python API review).
    if isinstance(skip_batches, bool) or not isinstance(skip_batches, (int, np.integer)) or skip_batches < 0:
        raise DataValueError(f"skip_batches={skip_batches!r} must be a whole number of batches >= 0.")
    if isinstance(columns, str):  # read as its letters: "Columns ['i', 'd'] are not in the dataset"
        raise DataTypeError(f"columns={columns!r} must be a list of column names, e.g. columns=[{columns!r}].")
    if columns is not None and len(columns) == 0:
        raise DataValueError("columns=[] keeps no column, so no batch could hold a row; name the columns to feed, or "
                             "leave columns out for all of them.")
    if local_shuffle_seed is not None and local_shuffle_buffer_size is None:
        raise DataValueError(f"local_shuffle_seed={local_shuffle_seed} shuffles nothing without "
                             "local_shuffle_buffer_size (rows to shuffle among); give both.")
    if not isinstance(mesh, jax.sharding.Mesh):
        raise DataTypeError(f"mesh must be a jax.sharding.Mesh (rjt.get_mesh() in a worker, or rjt.make_mesh(...)), "
                            f"got {type(mesh).__name__}")
    _check_dtypes(dtypes)
    check_batch_size(batch_size, mesh, batch_axes)
    batch_size = int(batch_size)  # a numpy integer passes the check, and goes into JSON and shapes below
    sharding = batch_sharding(mesh, batch_axes)
    local_rows = process_rows(sharding, batch_size)
    agreement = None
    if sync and jax.process_count() > 1:
        # What each process opened, compared before anything is read or even asked of Ray: iterators are matched
        # by opening order, and Ray waits without a timeout for every worker to ask for its shard of a dataset
        # and to read it, so a worker that opened another one hung the run. skip_batches too: the batch counts are
        # agreed before the skip, so a process that skipped fewer would step alone into a collective and hang.
        opened = json.dumps([dataset if isinstance(dataset, str) else type(dataset).__name__, batch_size, remainder,
                             sorted(columns) if columns is not None else None, f"skip_batches={skip_batches}"])
        agreement = _Agreement(next(_call_counter), sync_timeout_s, opened, sync_window)
        agreement.compare_opened()
    iterator = resolve_dataset(dataset)
    if isinstance(dataset, str):
        _check_split(dataset, iterator)
    _end_the_open_epoch(iterator)
    # Ray Data pays a fixed cost per batch; read several steps' rows at once and slice them here.
    read_rows = local_rows * max(1, -(-min_read_rows // local_rows))
    host_batches = iterator.iter_batches(
        batch_size=read_rows,
        batch_format="numpy",
        drop_last=False,
        prefetch_batches=max(1, prefetch),
        local_shuffle_buffer_size=local_shuffle_buffer_size,
        local_shuffle_seed=local_shuffle_seed,
    )
    layout = _ColumnLayout()
    read = _RowCount(_split_rows(layout.checked(_select(batch, columns, dtypes) for batch in host_batches),
                                 local_rows))
    host_batches = read
    if agreement is not None:
        host_batches = _synchronised(host_batches, local_rows, remainder, mask_key, agreement, sync_window, layout)
    else:
        host_batches = _local_only(host_batches, local_rows, remainder, mask_key)
    host_batches = _skipped(_refuse_if_all_dropped(host_batches, read, local_rows, batch_size, agreement),
                            skip_batches)

    global_shape_of = lambda array: (batch_size,) + array.shape[1:]  # noqa: E731

    def to_device(batch: Dict[str, np.ndarray]):
        return {
            key: jax.make_array_from_process_local_data(sharding, value, global_shape_of(value))
            for key, value in batch.items()
        }

    stop = threading.Event()
    if agreement is not None:
        agreement.stop = stop
    batches = _prefetched((to_device(batch) for batch in host_batches), prefetch, stop,
                          agreement.raise_if_never if agreement is not None else None)
    if _is_split_shard(iterator):
        _open_epochs[iterator] = weakref.ref(batches)
    return batches


# The batches last opened on each Ray DataIterator. Ray's split iterator ends an epoch when its reader closes, and
# takes the epoch to end from the iterator object, so an epoch abandoned earlier and closed after the next one had
# started (by garbage collection, or by the caller, later) ended that next one: it gave no batch.
_open_epochs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _end_the_open_epoch(iterator) -> None:
    """Only for a trainer dataset's shard (Ray's split iterator), whose epochs run one at a time anyway: a Dataset or
    its plain iterator runs each pass apart, and two open at once (an eval mid-epoch, a zip) must both go on."""
    if not _is_split_shard(iterator):
        return
    earlier = _open_epochs.pop(iterator, None)
    batches = earlier() if earlier is not None else None
    if batches is not None:
        if not batches.finished:
            logger.debug("Ending the epoch of an earlier iterator over this shard, still open: a new one opens.")
        batches.close()


def _is_split_shard(iterator) -> bool:
    try:
        from ray.data._internal.iterator.stream_split_iterator import StreamSplitDataIterator
    except ImportError:  # pragma: no cover - a Ray that moved it: every iterator is then left alone
        return False
    return isinstance(iterator, StreamSplitDataIterator)


def _skipped(batches, skip: int):
    """`batches` after the first `skip`. Skipping past the end (not to it: a position saved on an epoch's last
    batch resumes there) warns: a resume whose saved position no longer fits the data (other data, another
    batch_size) otherwise trained nothing from this iterator without a word."""
    available = 0
    for batch in batches:
        if available >= skip:
            yield batch
        available += 1
    if skip > available:
        logger.warning("iter_jax_batches(skip_batches=%d): the data holds only %d global batches, so this iterator "
                       "gives none. A resume's saved position that no longer fits the data (other data or another "
                       "batch_size than the run saved it with) does this, as does a count of batches kept across "
                       "epochs: skip_batches is a position within one epoch (save the epoch beside it).",
                       skip, available)


class _RowCount:
    """An iterator of host batches that counts the rows it gave."""

    def __init__(self, batches):
        self._batches, self.rows = batches, 0

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._batches)
        self.rows += _rows(batch)
        return batch


class NoFullBatchError(DataValueError):
    """The data read holds fewer rows than one global batch: a loop over it would end at once, as if trained."""


def _refuse_if_all_dropped(batches, read: _RowCount, local_rows: int, batch_size: int,
                           agreement: Optional["_Agreement"] = None):
    """Pass `batches` on; if there were none although rows were read, raise, saying why: a loop over them just
    ended, and fit() reported success for a run that trained nothing. Every process raises, naming the ones whose
    shard was short: a process with rows enough blamed its own 40 rows and advised what did not help."""
    given = 0
    for batch in batches:
        given += 1
        yield batch
    counts = agreement.first_counts if agreement is not None else None
    if given:
        return
    import jax

    if not (read.rows or (counts and max(counts) > 0)):
        # No process read a row: a loop over it ended at once and fit() reported success (a Python API review).
        where = (f"on any of the {jax.process_count()} processes" if counts is not None else
                 f"on this process ({jax.process_index()} of {jax.process_count()})")
        raise NoFullBatchError(
            f"iter_jax_batches gave no batch: the data gave no rows at all, {where}. Check the dataset (a filter that kept nothing, empty files); a trainer's dataset is split "
            "equally, rows // workers to each, so one with fewer rows than workers gives every worker none.")

    short = [p for p, n in enumerate(counts or []) if n == 0]
    if counts and len(short) < len(counts):
        raise NoFullBatchError(
            f"iter_jax_batches gave no batch: a batch (batch_size={batch_size}) takes {local_rows} rows from each of "
            f"the {jax.process_count()} processes, and process(es) {short} had fewer than that (this one, "
            f"process {jax.process_index()}, read {read.rows}); remainder='drop' yields only batches every process "
            "fills. Give each worker rows enough (more data, or a split that shares them out), a smaller "
            "batch_size, or (iter_jax_batches in a loop of your own) remainder='pad' where every worker has a row.")
    raise NoFullBatchError(
        f"iter_jax_batches gave no batch although this process read {read.rows} rows: a batch "
        f"(batch_size={batch_size}) takes {local_rows} rows from each of the {jax.process_count()} processes, "
        "and remainder='drop' drops a tail too short for that. Use a smaller batch_size, more data, or (iter_jax_batches "
        "in a loop of your own) remainder='pad'.")


def _split_rows(batches, rows: int):
    """Cut host reads into per-step pieces of exactly `rows`; only the stream's last piece may be short.

    Ray Data's prefetch threads do not keep order, so a read's short tail can arrive before full reads. A
    short piece is therefore carried into the next read (copying just the rows it needs), never yielded
    mid-stream: the multi-process agreement takes a short piece for the end of the data, and would otherwise
    end the epoch early, or at once. Full pieces are views, no copies.
    """
    carry = None
    for batch in batches:
        total, start = _rows(batch), 0
        if carry is not None and total:
            start = min(rows - _rows(carry), total)
            carry = {key: np.concatenate([carry[key], batch[key][:start]]) for key in carry}
            if _rows(carry) < rows:
                continue
            yield carry
            carry = None
        while total - start >= rows:
            yield {key: value[start:start + rows] for key, value in batch.items()}
            start += rows
        if start < total:
            carry = {key: value[start:] for key, value in batch.items()}
    if carry is not None:
        yield carry


def _check_dtypes(dtypes) -> None:
    """Each dtype given is one numpy knows, said by column before anything is read (numpy's own error, from the
    reader thread, named no column)."""
    pairs = dtypes.items() if isinstance(dtypes, Mapping) else [("every column", dtypes)]
    for column, dtype in pairs:
        if dtype is None:
            continue
        try:
            np.dtype(dtype)
        except TypeError as exc:
            what = f"column {column!r}" if column != "every column" else column
            raise DataValueError(f"dtypes: {dtype!r} for {what} is not a dtype ({exc}); e.g. np.int32, 'float32' or "
                                 "jnp.bfloat16") from None


def _select(batch: Dict[str, np.ndarray], columns, dtypes) -> Dict[str, np.ndarray]:
    if isinstance(dtypes, Mapping) and batch:
        unknown = [c for c in dtypes if c not in batch or (columns is not None and c not in columns)]
        if unknown:  # a misspelt column would keep its dtype, silently
            raise DataValueError(f"dtypes names columns {unknown} that the batches do not have; they have "
                                 f"{sorted(columns if columns is not None else batch)}.")
    if columns is not None:
        missing = [c for c in columns if c not in batch]
        if missing:
            raise DataValueError(f"Columns {missing} are not in the dataset; it has {sorted(batch)}.")
        batch = {c: batch[c] for c in columns}
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        was = value.dtype
        if value.dtype == object:
            was = type(value[0]).__name__ if len(value) else "object"  # "str", as before it was stacked
            value = _stack_object_column(key, value)
        dtype = dtypes.get(key) if isinstance(dtypes, Mapping) else dtypes
        if value.dtype.kind in "US":  # numbers written as text convert with a dtypes entry; other text cannot
            value = _parse_numbers(key, value, dtype, was)
        _check_integers_fit(key, value, dtype)
        out[key] = value.astype(dtype, copy=False) if dtype is not None else value
    return out


def _parse_numbers(key: str, value: np.ndarray, dtype, was) -> np.ndarray:
    """A text column as numbers, for the checks and the cast that follow. Integers parse as integers (ids past
    2**53 would round as floats); anything else as float64, not as the dtype itself: numpy's text -> bool cast
    makes "0" True."""
    text, target = was, np.dtype(dtype) if dtype is not None else None
    try:
        try:
            parsed = value.astype(target if target is not None and target.kind in "iu" else np.float64)
        except ValueError:  # "1.5" for an integer dtype: as a float, the check that follows says it has fractions
            parsed = value.astype(np.float64)
    except ValueError as exc:
        unparsed = f" ({exc})" if dtype is not None else ""
        raise DataTypeError(f"Column {key!r} holds text ({text}), which cannot become a jax.Array{unparsed}. "
                            f"{_TEXT_HINT}") from None
    except OverflowError as exc:
        raise DataValueError(f"dtypes converts column {key!r}, numbers written as text, to {target}, which cannot "
                             f"hold them ({exc}). Use a dtype that holds them.") from None
    if dtype is None:
        raise DataTypeError(f"Column {key!r} holds numbers written as text ({text}). Give it a dtypes entry "
                            f"(dtypes={{{key!r}: 'float32'}}) to convert them, or convert them in a map_batches "
                            "step first.")
    return parsed


def _on_device(dtype) -> np.dtype:
    """The dtype an array of `dtype` has once on the devices: JAX narrows 64-bit types without jax_enable_x64."""
    import jax

    dtype = np.dtype(dtype)
    if dtype.itemsize == 8 and dtype.kind in "iuf" and not jax.config.jax_enable_x64:
        return np.dtype({"i": np.int32, "u": np.uint32, "f": np.float32}[dtype.kind])
    return dtype


_X64_FIX = "jax.config.update('jax_enable_x64', True) in the training loop before any array is made"


def _check_integers_fit(key: str, value: np.ndarray, dtype) -> None:
    """Integers narrowed on the way to the devices must fit: numpy's astype and JAX's int64 -> int32 (without
    jax_enable_x64) both wrap silently, so an id of 2**31 would train as a negative number."""
    import jax

    if not value.size:
        return
    if value.dtype.kind == "f" and dtype is not None and np.dtype(dtype).kind in "iub":
        # Against the dtype on the devices: a float 3e9 cast to the requested int64 fits, then JAX's int32 wraps it.
        _check_floats_become_integers(key, value, np.dtype(dtype), _on_device(dtype))
        return
    if value.dtype.kind in "iu" and dtype is not None and np.dtype(dtype).kind == "b":
        _check_zeros_and_ones(key, value)
        return
    requested = np.dtype(dtype) if dtype is not None else value.dtype
    target = _on_device(requested)
    _check_no_overflow_to_inf(key, value, target, narrowed_by_jax=target != requested)
    if value.dtype.kind not in "iu":
        return
    if target.kind in "iu" and target.itemsize >= value.dtype.itemsize and target.kind == value.dtype.kind:
        return
    low, high = value.min(), value.max()
    if jax.numpy.issubdtype(target, jax.numpy.floating):  # bfloat16 too, whose numpy kind is "V"
        exact = 2 ** (jax.numpy.finfo(target).nmant + 1)  # integers beyond this round to their neighbours
        if max(abs(int(low)), abs(int(high))) > exact and key not in _warned_rounding:
            _warned_rounding.add(key)
            logger.warning("Column %r holds integers up to %d, past %s's exact range (+-%d): they round, and "
                           "distinct ids may become one value. Keep it an integer column if they are ids.",
                           key, max(abs(int(low)), abs(int(high))), target, exact)
        return
    if target.kind not in "iu":
        return
    info = np.iinfo(target)
    if low < info.min or high > info.max:
        wider = (f"64-bit integers on the devices: {_X64_FIX}" if target != requested else
                 f"an integer dtypes entry that holds them (dtypes={{{key!r}: ...}})")
        raise DataValueError(
            f"Column {key!r} holds {value.dtype} values from {low} to {high}, outside {target}'s range "
            f"[{info.min}, {info.max}], to which it is converted on the way to the devices (it would wrap silently). "
            f"Fix the data (e.g. renumber the ids into a smaller range), or use {wider}; not a float dtype, which "
            f"rounds integers this large.")


_warned_rounding: set = set()


def _check_no_overflow_to_inf(key: str, value: np.ndarray, target: np.dtype, *, narrowed_by_jax: bool) -> None:
    """Numbers narrowed to a smaller float (float16's largest is 65504) become inf with only numpy's warning, and
    the loss turns inf or NaN steps later, far from the cause (a data review)."""
    import jax.numpy as jnp

    if not jnp.issubdtype(target, jnp.floating):  # bfloat16 too, whose numpy kind is "V"
        return
    if value.dtype.kind in "iu":
        source_largest = float(np.iinfo(value.dtype).max)
    elif jnp.issubdtype(value.dtype, jnp.floating):
        source_largest = float(jnp.finfo(value.dtype).max)
    else:
        return
    info = jnp.finfo(target)
    # Values from here on round to inf (round to nearest: half an ulp past the largest still rounds down to it).
    limit = float(info.max) + 2.0 ** (info.maxexp - info.nmant - 2)
    if source_largest < limit:
        return  # nothing this column's type holds can overflow (int32 into float32, float16 into bfloat16)
    low, high = value.min(), value.max()
    if value.dtype.kind == "f" and not (np.isfinite(low) and np.isfinite(high)):  # NaN or inf of the data's own
        low = high = np.max(np.abs(value), where=np.isfinite(value), initial=0.0)
    biggest = max(abs(float(low)), abs(float(high)))
    if biggest >= limit:
        fix = (f"keep 64-bit floats on the devices ({_X64_FIX})" if narrowed_by_jax else
               f"use a dtypes entry that holds them (e.g. dtypes={{{key!r}: 'float32'}})")
        raise DataValueError(
            f"Column {key!r} holds {value.dtype} values up to {biggest:g}, past {target}'s largest "
            f"({float(info.max):g}), to which it is converted on the way to the devices: they would become inf, "
            f"silently. Scale them first, or {fix}.")


def _check_floats_become_integers(key: str, value: np.ndarray, target: np.dtype,
                                  on_device: Optional[np.dtype] = None) -> None:
    """A `dtypes` entry that casts floats to integers or bools: numpy turns NaN (a null) into -2**31 or True and
    wraps values out of range, silently (a data review). `on_device` is what JAX narrows `target` to, if it does."""
    if not np.isfinite(value).all():
        raise DataValueError(
            f"dtypes casts column {key!r} from {value.dtype} to {target}, but it holds NaN or inf: a null in an "
            f"integer column arrives as NaN, which the cast would turn into "
            f"{'True' if target.kind == 'b' else 'an arbitrary integer'}, silently. Fill or drop the nulls in a "
            "map_batches step first.")
    if target.kind == "b":
        _check_zeros_and_ones(key, value)
    if target.kind in "iu":
        landed = target if on_device is None else on_device
        info = np.iinfo(landed)
        low, high = value.min(), value.max()
        whole = np.array_equal(value, np.trunc(value))
        if low < info.min or high > info.max or not whole:
            narrowed = (f" ({target} becomes {landed} on the devices without jax_enable_x64)" if landed != target
                        else "")
            x64 = f" (64-bit integers on the devices: {_X64_FIX})" if landed != target else ""
            raise DataValueError(
                f"dtypes casts column {key!r} from {value.dtype} to {target}{narrowed}, but it holds values from "
                f"{low} to {high}{'' if whole else ' and fractions'}, which the "
                f"cast would {'wrap' if low < info.min or high > info.max else 'truncate'} silently. Use a dtype "
                f"that holds them{x64}{'' if whole else ', or round them yourself first'}.")


def _check_zeros_and_ones(key: str, value: np.ndarray) -> None:
    """A cast to bool makes every value but 0 True: ids 0..19 became one False and nineteen Trues, 0.5 True,
    silently (a data review)."""
    others = np.unique(value[(value != 0) & (value != 1)])
    if others.size:
        raise DataValueError(
            f"dtypes casts column {key!r} from {value.dtype} to bool, but it holds values other than 0 and 1 "
            f"({', '.join(map(str, others[:4].tolist()))}{', ...' if others.size > 4 else ''}), which the cast "
            "would make True, silently. Turn them into 0 and 1 (a comparison, batch[...] > threshold) in a "
            f"map_batches step first, or give column {key!r} a dtype that holds them.")


class _ColumnLayout:
    """Each column's dtype and row shape, held the same over this process's reads and (through the agreement) over
    the processes. `make_array_from_process_local_data` joins the processes' pieces without comparing them: a
    worker whose column arrived as floats (a null in an integer column) or with lists of another length gave every
    process a corrupted global batch, silently (a data review); in one process the column changed dtype mid-epoch."""

    def __init__(self):
        self.first: Optional[Dict[str, Tuple[str, Tuple[int, ...]]]] = None
        self.text = ""  # what the agreement compares; empty until this process has read a row

    def checked(self, batches):
        for batch in batches:
            if not _rows(batch):
                yield batch
                continue
            layout = {key: (value.dtype.name, tuple(value.shape[1:])) for key, value in batch.items()}
            if self.first is None:
                self.first = layout
                self.text = json.dumps([[key, dtype, list(shape)] for key, (dtype, shape) in layout.items()])
            elif set(layout) != set(self.first):
                raise DataValueError(f"iter_jax_batches: the batches' columns changed from {sorted(self.first)} to "
                                     f"{sorted(layout)}; every read must have the same columns (select them with "
                                     "columns=[...]).")
            elif layout != self.first:
                changed = [key for key in layout if layout[key] != self.first.get(key)]
                raise DataValueError(
                    "iter_jax_batches: " + "; ".join(
                        f"column {key!r} arrived as {self.first[key][0]} rows of shape {self.first[key][1]} in "
                        f"earlier reads and as {layout[key][0]} of shape {layout[key][1]} now"
                        for key in changed if key in self.first) + f". {_LAYOUT_HINT}")
            yield batch


_LAYOUT_HINT = ("A null in an integer column makes Ray Data hand the column over as floats (NaN for the nulls), and "
                "list columns of different lengths give rows of other shapes. Fill or drop the nulls and pad the "
                "lists to one length in a map_batches step first, or leave the column out with columns=[...].")


def _shape_of(item):
    try:
        return np.shape(item)
    except ValueError:  # ragged within a row: numpy refuses to give it a shape
        return f"ragged {type(item).__name__} of {len(item)}"


_TEXT_HINT = "Tokenise it into integer ids in a map_batches step first, or drop the column with columns=[...]."


def _stack_object_column(key: str, value: np.ndarray) -> np.ndarray:
    try:
        stacked = np.stack([np.asarray(item) for item in value])
    except ValueError:
        stacked = None
    if stacked is not None and stacked.dtype != object:
        # The usual case: what follows only explains a failure, row by row. Text goes on too, as Ray Data hands
        # string columns over as objects: numbers written as text convert with a dtypes entry (`_parse_numbers`).
        return stacked
    first = value[0] if len(value) else None
    nulls = [i for i, item in enumerate(value) if item is None]
    if nulls:
        raise DataTypeError(
            f"Column {key!r} holds nulls (None, in {len(nulls)} of the {len(value)} rows of this read), which cannot "
            "become part of a jax.Array. Fill or drop them in a map_batches/filter step first, or drop the column "
            "with columns=[...].")
    if isinstance(first, Mapping):
        raise DataTypeError(
            f"Column {key!r} holds nested records (dicts with keys {sorted(first)[:8]}), which cannot become one "
            "jax.Array. Flatten them into columns of their own in a map_batches step first (e.g. "
            f"batch['{key}_{sorted(first)[0] if first else 'x'}'] = ...), or drop the column with columns=[...].")
    if isinstance(first, (str, bytes)) and (stacked is None or stacked.dtype.kind in "USO"):
        raise DataTypeError(f"Column {key!r} holds text ({type(first).__name__}), which cannot become a jax.Array. "
                            f"{_TEXT_HINT}")
    if stacked is None:
        shapes = sorted({_shape_of(item) for item in value}, key=str)
        raise DataTypeError(
            f"Column {key!r} holds rows of different shapes ({', '.join(map(str, shapes[:4]))}"
            f"{', ...' if len(shapes) > 4 else ''}), which cannot become one jax.Array. Pad them to one length in "
            "a map_batches step first (with a mask column if the padding must not count), or drop the column with "
            "columns=[...].")
    raise DataTypeError(
        f"Column {key!r} holds {value[0].__class__.__name__} values of varying shape or a non-numeric type, "
        "which cannot become a jax.Array. Tokenise/pad it in a map_batches step first, or drop it with "
        "columns=[...].")


def _pad(batch: Dict[str, np.ndarray], rows: int, mask_key: str) -> Dict[str, np.ndarray]:
    if mask_key in batch:  # the mask would replace the data's own column, silently
        raise DataValueError(f"remainder='pad' adds a boolean column {mask_key!r} that marks real rows, but the data "
                             f"has a column {mask_key!r} already. Pass mask_key='...' with another name, or rename the "
                             "column.")
    have = len(next(iter(batch.values())))
    out = {}
    for key, value in batch.items():
        padded = np.zeros((rows,) + value.shape[1:], dtype=value.dtype)
        padded[:have] = value
        out[key] = padded
    mask = np.zeros((rows,), dtype=bool)
    mask[:have] = True
    out[mask_key] = mask
    return out


def _rows(batch) -> int:
    return len(next(iter(batch.values()))) if batch else 0


def _local_only(batches, rows: int, remainder: str, mask_key: str):
    for batch in batches:
        if _rows(batch) == rows:
            yield _pad(batch, rows, mask_key) if remainder == "pad" else batch
        elif remainder == "pad" and _rows(batch):
            yield _pad(batch, rows, mask_key)


class _ReaderStopped(Exception):
    """The consumer of the batches stopped while their reader waited for the other processes."""


class _Agreement:
    """Host-side agreement between processes through jax.distributed's key-value store.

    Kept off the device on purpose: a device collective issued from the prefetch thread could interleave
    differently with the step's collectives on different processes and deadlock.
    """

    def __init__(self, call_id: int, timeout_s: float, opened: str = "", window: int = 1):
        import jax
        from jax._src import distributed

        self._opened = opened
        self._client = distributed.global_state.client
        self._prefix = f"ray_jax_train/batches/{call_id}"
        self._rank = jax.process_index()
        self._size = jax.process_count()
        self._timeout_ms = int(timeout_s * 1000)
        self._round = 0
        self.first_counts: Optional[List[int]] = None  # each process's full batches in the first window
        self.stop: Optional[threading.Event] = None  # set when the consumer has stopped
        self.layouts: Dict[int, str] = {}  # the last round's `_ColumnLayout.text` of each process that has rows
        self._window = window

    warn_after_s = 60.0  # a wait this long warns, naming the processes not yet there
    _window = 1  # batches per round (sync_window): a round's first batch names it in errors
    # What `_collect` waits for now: (key, first batch of the round or None at the opening, missing processes).
    waiting: Optional[Tuple[str, Optional[int], List[int]]] = None

    def compare_opened(self) -> None:
        """At the opening, before any read: every process must have opened the same iterator at this point. Called
        in the thread that reports (the loop's), which `why_never` needs."""
        from ray_jax_train.checkpoint._sync import note_waiting_thread

        note_waiting_thread()
        key = f"{self._prefix}/open"
        self._client.key_value_set(f"{key}/{self._rank}", self._opened)
        answers = self._collect(key, None)
        opened = [answers[p] for p in range(self._size)]
        if len(set(opened)) > 1:
            raise RuntimeError(
                "The processes opened different iterators at the same point (they are matched by opening "
                f"order): {', '.join(f'process {p}: {o}' for p, o in enumerate(opened))}. Open the same "
                "iter_jax_batches calls in the same order on every worker.")

    def gather(self, value: int, layout: str = "") -> list:
        """Every process's `value` for this round; `layout` (`_ColumnLayout.text`) must agree among the
        processes that have read rows, else every process raises the same error."""
        key = f"{self._prefix}/{self._round}"
        self._client.key_value_set(f"{key}/{self._rank}", f"{value}|{layout}")
        collected = self._collect(key, self._round * self._window)
        answers = [collected[p].partition("|") for p in range(self._size)]
        values = [int(count) for count, _, _ in answers]
        self.layouts = {p: text for p, (_, _, text) in enumerate(answers) if text}
        if len(set(self.layouts.values())) > 1:
            raise DataValueError(
                "iter_jax_batches: the processes' batches differ in their columns' dtypes or row shapes, which "
                "would join into a corrupted global batch: " + "; ".join(
                    f"process {p}: {' '.join(f'{k}:{d}{list(shape)}' for k, d, shape in json.loads(text))[:300]}"
                    for p, text in sorted(self.layouts.items())) + f". {_LAYOUT_HINT}")
        # Every process has now set this round's key, so each has read all of the round before (and what the
        # others opened): those keys are never read again. Deleting them keeps the coordinator's store small.
        if self._round == 0:
            self._client.key_value_delete(f"{self._prefix}/open/{self._rank}")
        else:
            self._client.key_value_delete(f"{self._prefix}/{self._round - 1}/{self._rank}")
        self._round += 1
        return values

    def _collect(self, key: str, batch: Optional[int]) -> Dict[int, str]:
        """Every process's value under `key/<process>`: at the opening (`batch` None) or at the round that starts
        at `batch`. Waited for in slices, so that a process that will never write fails this one at once (its
        training function has returned, or it waits in ray.train.report), a minute's wait warns, and the deadline
        says who is missing and why; a bare blocking get hung silently for the whole sync timeout (30 minutes),
        then named only a key. A consumer that stops (an eval capped at max_eval_steps) ends the wait too: the
        other process, stopped a round earlier, never sets this round's key, and the wait held the reader, and
        Ray's reader under it, for the whole sync timeout (an epoch left open that long ended a later one)."""
        import time

        answers: Dict[int, str] = {}
        started = time.monotonic()
        deadline, warned = started + self._timeout_ms / 1000, False
        try:
            while True:
                missing = []
                for p in range(self._size):
                    if p not in answers:
                        try:
                            answers[p] = self._client.key_value_try_get(f"{key}/{p}")
                        except Exception:  # noqa: BLE001 - JaxRuntimeError NOT_FOUND: not written yet
                            missing.append(p)
                if not missing:
                    return answers
                self.waiting = (key, batch, missing)
                left_ms = int((deadline - time.monotonic()) * 1000)
                try:  # a blocking get on one of them: woken at once when it comes, not at the next poll
                    answers[missing[0]] = self._client.blocking_key_value_get(f"{key}/{missing[0]}",
                                                                              max(1, min(1000, left_ms)))
                    continue
                except Exception as exc:  # noqa: BLE001 - JaxRuntimeError; only its text tells a timeout
                    if "DEADLINE_EXCEEDED" not in str(exc):
                        raise
                if self.stop is not None and self.stop.is_set():
                    raise _ReaderStopped()
                self.raise_if_never()
                waited = time.monotonic() - started
                if waited >= self._timeout_ms / 1000:
                    raise self._timed_out(batch, missing, waited) from None
                if waited > self.warn_after_s and not warned:
                    warned = True
                    logger.warning("iter_jax_batches (%s) on process %d has waited %.0fs for processes %s %s.",
                                   self._opened, self._rank, waited, missing,
                                   "to open their matching iterator (iterators are matched by opening order): a "
                                   "worker that opens fewer calls or none makes this one wait until sync_timeout_s"
                                   if batch is None else
                                   f"to read their share of batch {batch}: a worker that stopped iterating early "
                                   "makes this one wait until sync_timeout_s; one that is only slower arrives later")
        finally:
            self.waiting = None

    def raise_if_never(self) -> None:
        """Raise where a process this one waits for (`waiting`) will never write its key. Also called from the
        consumer's thread while it waits for a batch: a wait in ray.train.report is told only there (the thread
        that reports), not in the reader's."""
        from ray_jax_train.checkpoint._sync import why_never

        waiting = self.waiting
        if waiting is None:
            return
        key, batch, missing = waiting
        # Raised `from None`: a chained cause put Ray's error snippet's cut before the advice.
        for p in missing:
            never = why_never(self._client, p, f"{key}/{p}")
            if not never:
                continue
            if batch is None:  # an eval on rank 0 only, say: waited for sync_timeout_s (30 minutes by default)
                raise IteratorsOutOfStepError(
                    f"iter_jax_batches ({self._opened}) is open on process {self._rank}, and process {p} "
                    f"will never open its matching iterator: {never}. Open the same iter_jax_batches calls "
                    "in the same order on every worker: each batch spans them all (evaluate on every "
                    "worker, and let rank 0 alone write files, not read data).") from None
            raise IteratorsOutOfStepError(
                f"iter_jax_batches ({self._opened}) on process {self._rank} reads batch {batch}, which process {p} "
                f"will never read: {never}. Each batch spans every process, so {_STOPPED_EARLY}") from None

    def _timed_out(self, batch: Optional[int], missing: List[int], waited: float) -> Exception:
        if batch is None:
            return RuntimeError(
                f"iter_jax_batches ({self._opened}) waited {waited:.0f}s for processes {missing} to open their "
                "matching iterator; they opened fewer iter_jax_batches calls than this one. Open the same calls in "
                "the same order on every worker (sync_timeout_s sets this wait).")
        return RuntimeError(
            f"iter_jax_batches ({self._opened}) on process {self._rank} waited {waited:.0f}s at batch {batch} for "
            f"processes {missing}, whose readers never reached it. Each batch spans every process, so "
            f"{_STOPPED_EARLY} If they are only slower (a long step or eval on some workers), raise sync_timeout_s.")


_STOPPED_EARLY = ("a worker that stops iterating early (a break, a return, an error caught in its loop) leaves the "
                  "others waiting for its share of the next batch. Break out of the loop on every worker together "
                  "(at the same batch), or iterate to the end everywhere.")


class IteratorsOutOfStepError(RuntimeError):
    """Some process will never read the iterator this one waits in: its loop stopped early or opened fewer."""

    retry_repeats_it = True  # the same loop stops at the same place on every attempt (ray_jax_train.retries)


def _synchronised(batches, rows: int, remainder: str, mask_key: str, agreement: _Agreement, window: int,
                  layout: Optional[_ColumnLayout] = None):
    """Read `window` local batches, agree on how many every process yields (and that their columns match),
    repeat."""
    template = None
    while True:
        chunk = list(itertools.islice(batches, window))
        if chunk:
            template = chunk[0]
        if remainder == "drop":
            full = 0
            while full < len(chunk) and _rows(chunk[full]) == rows:
                full += 1
            counts = agreement.gather(full, layout.text if layout else "")
            if agreement.first_counts is None:
                agreement.first_counts = list(counts)
            agreed = min(counts)
            yield from chunk[:agreed]
        else:
            counts = agreement.gather(len(chunk), layout.text if layout else "")
            if agreement.first_counts is None:
                agreement.first_counts = list(counts)
            agreed = max(counts)
            if template is None and agreed:
                # An empty shard (a split that gave this worker no block, `JaxDataConfig(every_row=...)`) pads
                # in the layout of a process that has rows, which the agreement has just compared.
                import jax.numpy as jnp

                template = {key: np.zeros([0] + shape, jnp.dtype(dtype))
                            for key, dtype, shape in json.loads(next(iter(agreement.layouts.values())))}
            for i in range(agreed):
                yield _pad(chunk[i] if i < len(chunk) else {k: v[:0] for k, v in template.items()}, rows, mask_key)
        if agreed < window:
            return


_DONE = object()


def _prefetched(iterable, depth: int, stop: Optional[threading.Event] = None, on_wait=None):
    """Run `iterable` (host read + device put) in a thread, `depth` items ahead of the consumer.

    The thread starts now, not at the first `next()`: a loop that opens its data before building and compiling
    its state gets Ray Data's start-up (seconds for the first block) done in the meantime.

    A consumer that stops early (an eval capped at max_eval_steps) closes the reading chain from this thread and
    waits for it: Ray's split iterator ends its epoch when its generator is closed, and reads the epoch to end from
    the iterator object. Left to garbage collection, an abandoned epoch's close came after the next epoch of the
    same shard had started, ended that one instead, and the next eval got no batch at all.

    `on_wait` is called in the consumer's thread about every second that it waits for an item, and may raise.
    """
    buffer: "queue.Queue" = queue.Queue(maxsize=depth)
    stop = stop or threading.Event()

    def put(item) -> bool:
        """Hand `item` over, or give up once the consumer has gone (a blocking put would keep this thread, and
        the batches and readers it holds, alive forever after a consumer that stops early)."""
        while not stop.is_set():
            try:
                buffer.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        try:
            for item in iterable:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as exc:  # surfaced in the consumer, never swallowed
            put(exc)
        finally:
            close = getattr(iterable, "close", None)
            if close is not None:
                close()  # ends the generators below it, Ray's reader last, here and now

    thread = threading.Thread(target=produce, name="ray_jax_train-prefetch", daemon=True)
    thread.start()
    return _Prefetched(buffer, stop, thread, on_wait)


_PRODUCER_JOIN_S = 30.0  # a reader blocked past this (on other workers' data) is left to finish on its own


class _Prefetched:
    """The consumer's side of `_prefetched`: an iterator whose `close()` (also at its end, and at an error) stops
    the reading thread and waits for it to close the readers."""

    def __init__(self, buffer: "queue.Queue", stop: threading.Event, producer: threading.Thread, on_wait=None):
        self._buffer, self._stop, self._producer, self._done = buffer, stop, producer, False
        self._on_wait = on_wait
        # Dropped without close() (a loop that breaks and forgets it): the thread still stops.
        weakref.finalize(self, stop.set)

    @property
    def finished(self) -> bool:
        return self._done

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        while True:
            try:
                item = self._buffer.get(timeout=None if self._on_wait is None else 1.0)
                break
            except queue.Empty:
                try:
                    self._on_wait()
                except BaseException:
                    self.close()
                    raise
        if item is _DONE:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    def close(self) -> None:
        self._done = True
        self._stop.set()
        if self._producer is not threading.current_thread():
            self._producer.join(_PRODUCER_JOIN_S)
        try:  # a thread still waiting in next() (a compile-ahead helper) gets the end instead of waiting forever
            self._buffer.put_nowait(_DONE)
        except queue.Full:
            pass
