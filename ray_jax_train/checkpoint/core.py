"""Sharded, asynchronous train-state checkpoints that Ray Train registers and retains.

Design, and why:

* Orbax writes straight into the run's storage directory (`<storage_path>/<run name>/checkpoint_...`). Every
  process writes only the shards it owns; nothing is gathered on one host and nothing is copied afterwards.
  For that, all processes must see one directory: a local path on one node, a shared filesystem, or a cloud
  URI orbax can write (`gs://`, and `s3://` on AWS or an S3-compatible endpoint, see `_s3.py`).
* Orbax writes into `<name>.orbax-checkpoint-tmp` and the primary process renames it to `<name>` only after
  every process has finished, so a final directory is always complete. Object stores cannot rename a
  directory: there orbax writes `<name>` itself and the primary adds `commit_success.txt` last.
* The checkpoint is reported to Ray with `CheckpointUploadMode.ASYNC` and an "upload" function that only waits
  for that orbax save to commit and copies nothing. Ray therefore registers a checkpoint only once it is
  complete (a worker that dies mid-save reports nothing), retention (`CheckpointConfig.num_to_keep`, score
  attribute/order) stays Ray's, and the step loop goes on while bytes go to storage: Ray runs the wait in
  its upload thread and keeps reports in order.
* Names carry the step and a per-incarnation token, so a save repeated after a restart never reuses the
  path of a checkpoint Ray already tracks (its retention would otherwise delete the new one with the old).
* Every checkpoint records an order-independent integer checksum of each array (programs the step loop only
  enqueues, one per local shard and free of device collectives; the processes add their shares through the
  key-value store and the values go to `checksums.json` once orbax has committed). A restore that raises, finds
  files missing, or reads bytes whose checksum differs is rejected on all processes (they agree through the
  jax.distributed key-value store) and the previous reported checkpoint is tried, newest first.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import secrets
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ray_jax_train.checkpoint import _s3, _sync, orbax_guard, signals
from ray_jax_train.errors import UsageTypeError, UsageValueError
from ray_jax_train.storage import require_fsspec_client

logger = logging.getLogger(__name__)

FORMAT = "ray_jax_train.checkpoint/1"
STATE_ITEM, META_ITEM = "state", "meta"
META_FILE = f"{META_ITEM}/metadata"  # the JSON item: step, data position, checksums' file, the user's metadata
TMP_SUFFIX = ".orbax-checkpoint-tmp"
_NAME_RE = re.compile(r"^checkpoint_(\d{9})_([0-9a-f]{8})$")


class StorageNotSharedError(RuntimeError):
    """The workers do not all see the run's storage directory (a node-local path on a multi-node cluster)."""


class CheckpointCorruptError(RuntimeError):
    """A checkpoint directory that cannot be restored: missing files, unreadable data or a checksum mismatch."""

    # Not `retry_repeats_it`: storage out of reach (a bucket's outage, a mount not up yet) fails the same way, and
    # a retry is what resumes the run then. Damaged files do fail every attempt, but a restore fails before the
    # attempt's first report, so ray_jax_train.retries ends the run after RAY_JAX_TRAIN_RETRIES_WITHOUT_PROGRESS
    # (5) such attempts in a row even with max_failures=-1: no endless loop.


class RestoreTargetError(ValueError):
    """A restore target that no checkpoint can be read into (a leaf's sharding that does not divide its shape, or
    that places it on none of this process's devices): the user's target, not the checkpoint, is to be fixed.

    Raised before any checkpoint is read, so that a sound checkpoint is neither called corrupt nor skipped for an
    older one."""

    retry_repeats_it = True  # FailureConfig does not retry it (ray_jax_train.retries): every attempt builds it alike


class CheckpointMismatchError(ValueError):
    """A sound checkpoint of a different train state (other arrays, shapes or dtypes) than the run builds.

    Raised at once rather than falling back: the run's older checkpoints hold the same state, and calling the
    checkpoint corrupt would send the user looking for damage that is not there.
    """

    retry_repeats_it = True  # FailureConfig does not retry it (ray_jax_train.retries)


_MISMATCH = "holds a different train state than this run builds: "
_RUN_DIR = "is not a checkpoint but a directory of checkpoints: "
_A_FILE = "is a file, not a checkpoint directory"
_GONE = "the directory does not exist"
_READ = "reading it into the restore target failed: "


def _key_names(path) -> Tuple[str, ...]:
    """A pytree key path as plain names, the form orbax records (dict keys, attribute names, indices)."""
    names = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                names.append(str(getattr(entry, attr)))
                break
        else:
            names.append(str(entry))
    return tuple(names)


def leaf_paths(tree) -> List[str]:
    """Each leaf's path as "a/b/0", in leaf order: how checksums are matched to arrays, whatever the pytree types."""
    import jax

    return ["/".join(_key_names(p)) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _expected_for(recorded: Dict[str, list], target) -> list:
    """The recorded checksums (`{"paths": [...], "values": [...]}`) in `target`'s leaf order, None where absent."""
    by_path = dict(zip(recorded["paths"], recorded["values"]))
    return [by_path.get(path) for path in leaf_paths(target)]


def _describe(leaf) -> Tuple[Optional[tuple], Optional[str]]:
    import jax

    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return None, None  # key arrays are stored as their raw words: another shape and dtype, not compared
    return (None if shape is None else tuple(shape)), str(np.dtype(dtype))


def _state_mismatch(saved_tree, target, partial: bool = False, hint_partial: bool = True) -> Optional[str]:
    """What differs between a checkpoint's array metadata and the restore target, or None. A `partial` target
    may leave out arrays the checkpoint has."""
    import jax

    saved = {_key_names(p): _describe(x) for p, x in jax.tree_util.tree_flatten_with_path(saved_tree)[0]}
    wanted = {_key_names(p): _describe(x) for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}
    common = sorted(set(saved) & set(wanted))
    groups = [
        ("only in the checkpoint", [] if partial else [k for k in sorted(set(saved) - set(wanted))]),
        ("only in this run", [k for k in sorted(set(wanted) - set(saved))]),
        ("shapes differ (checkpoint vs this run)", [
            (k, saved[k][0], wanted[k][0]) for k in common
            if None not in (saved[k][0], wanted[k][0]) and saved[k][0] != wanted[k][0]]),
        ("dtypes differ (checkpoint vs this run)", [
            (k, saved[k][1], wanted[k][1]) for k in common
            if saved[k][1] and wanted[k][1] and saved[k][1] != wanted[k][1] and saved[k][0] == wanted[k][0]]),
    ]

    def show(item):
        return "/".join(item) if isinstance(item[0], str) else f"{'/'.join(item[0])} {item[1]} vs {item[2]}"

    parts = [f"{title} for {len(items)} array{'s' * (len(items) > 1)}: "
             + ", ".join(show(i) for i in items[:3]) + (", ..." if len(items) > 3 else "")
             for title, items in groups if items]
    if hint_partial and parts and all(title == "only in the checkpoint" for title, items in groups if items):
        parts.append("to read only the arrays the target names (e.g. the params of a whole train state), pass "
                     "partial=True")
    scalars = [(k, s, w) for k, s, w in groups[3][1] if saved[k][0] == ()]
    if scalars:  # a review: `"step": step + 1` made a placed int32 array a Python int, saved as int64
        k, s, w = scalars[0]
        parts.append(f"a 0-d leaf such as '{'/'.join(k)}' was saved as {s} where this run starts from {w}: a "
                     "Python number in the state (saved as int64 or float64) where the run starts from an array, "
                     "or the reverse, is the usual cause; keep each leaf's type through the loop (update the array, "
                     "e.g. state['step'] + 1, rather than put a new Python number in its place)")
    plain = [k for k in groups[1][1] if k[-1:] == ("value",) and k[:-1] in saved]
    if plain:  # the reverse of what _under_value reads: nnx Variables in the target, a pure dict in the checkpoint
        parts.append(f"the checkpoint holds {len(plain)} of this run's arrays without the '/value' level of an nnx "
                     f"Variable (e.g. '{'/'.join(plain[0][:-1])}': a state saved as nnx.to_pure_dict(...)): restore "
                     "into that pure-dict form, rjt.abstract_state(nnx.to_pure_dict(nnx.state(model))), and put "
                     "it back with nnx.replace_by_pure_dict(state, restored.state)")
    prefix = _common_prefix(groups[1][1], set(saved))
    if prefix:
        name = "/".join(prefix)
        parts.append(f"the checkpoint holds this run's arrays under '{name}/' (a state saved as "
                     f"{{'{prefix[0]}': ...}}): restore into a target with that nesting (partial=True reads only it)")
    return "; ".join(parts) or None


def _under_value(saved_tree, target) -> Tuple[Any, set]:
    """`target` with each leaf that the checkpoint holds one level down, under "value", made {"value": leaf}, and
    the key paths of those leaves.

    A checkpoint of nnx objects stores each Variable's array at ".../kernel/value"; Flax's own idiom for a restore
    target, `nnx.to_pure_dict(nnx.state(model))`, names it ".../kernel". Read as the same array (a shape, dtype and
    checksum still compared like any other): the only array at that place, and nothing else in the target can be
    meant. Before, it was "only in this run for 6 arrays: model/l1/bias ...", a state said to differ."""
    import jax

    saved = {_key_names(p) for p, _ in jax.tree_util.tree_flatten_with_path(saved_tree)[0]}
    moved = set()

    def one(path, leaf):
        key = _key_names(path)
        if key not in saved and key + ("value",) in saved:
            moved.add(key)
            return {"value": leaf}
        return leaf

    wrapped = jax.tree_util.tree_map_with_path(one, target)
    return (wrapped, moved) if moved else (target, moved)


def _common_prefix(missing: List[tuple], saved: set) -> Optional[tuple]:
    """The key prefix under which the checkpoint holds every array the target misses, if there is one: a model
    restored on its own from a checkpoint of {"model": ..., "opt": ...}."""
    if not missing:
        return None
    first = missing[0]
    for candidate in saved:
        if len(candidate) > len(first) and candidate[-len(first):] == first:
            prefix = candidate[:-len(first)]
            if all(prefix + key in saved for key in missing):
                return prefix
    return None


@dataclasses.dataclass
class Restored:
    """What `restore` returns: the state in its target shardings plus the bookkeeping saved with it."""

    state: Any
    step: int
    data_state: Any
    path: str
    metadata: Dict[str, Any]


# ------------------------------------------------------------------------------------------------------------
# Where checkpoints live
# ------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Location:
    filesystem: Any  # pyarrow.fs.FileSystem
    fs_path: str  # path on `filesystem`
    uri: str  # the same place as orbax/tensorstore address it

    def child(self, name: str) -> "_Location":
        return _Location(self.filesystem, f"{self.fs_path.rstrip('/')}/{name}", f"{self.uri.rstrip('/')}/{name}")


def _uri_for(filesystem, fs_path: str) -> str:
    import pyarrow.fs as pafs

    if isinstance(filesystem, pafs.LocalFileSystem):
        return fs_path
    if _s3.is_s3(filesystem):
        _s3.use(filesystem, fs_path)  # the URI drops the endpoint: orbax in this process must know it beforehand
    scheme = {"gcs": "gs", "s3": "s3"}.get(getattr(filesystem, "type_name", ""))
    if scheme == "gs":
        require_fsspec_client("gs")
    if scheme:
        return f"{scheme}://{fs_path.lstrip('/')}"
    raise UsageValueError(
        f"ray_jax_train checkpoints are written by orbax straight into the run directory, but the storage "
        f"filesystem {type(filesystem).__name__} has no URI orbax can write. Use a local or shared path "
        "(NFS, Lustre, a mounted bucket) or a gs:// or s3:// storage_path."
    )


def _run_location() -> _Location:
    import ray.train

    try:
        storage = ray.train.get_context().get_storage()
    except NotImplementedError:  # Ray's "Local storage context not yet implemented"
        raise RuntimeError(
            "Checkpoints need a run with Ray Train workers: ScalingConfig(num_workers=0) is Ray's local mode, which "
            "has no run storage to save into or restore from. Use ScalingConfig(num_workers=1) or more, or leave "
            "JaxCheckpointer / save_and_report / restore out of a local-mode run.") from None
    fs, path = storage.storage_filesystem, storage.experiment_fs_path
    return _Location(fs, path, _uri_for(fs, path))


def _absolute_if_local(filesystem, path: str) -> str:
    """`Checkpoint.from_directory("runs/x/checkpoint_...")` keeps the relative path, which orbax refuses ("should
    be absolute"), and which read as a corrupt checkpoint; a path given as a string was made absolute already."""
    import pyarrow.fs as pafs

    return os.path.abspath(path) if isinstance(filesystem, pafs.LocalFileSystem) else path


def checkpoint_text(checkpoint) -> str:
    """A `ray.train.Checkpoint` (what `fit()` returns), a path or a URI, as the path or URI string it names."""
    if hasattr(checkpoint, "filesystem") and hasattr(checkpoint, "path"):
        return _location_of(checkpoint).uri
    return os.fspath(checkpoint)


def _location_of(checkpoint) -> _Location:
    """A `ray.train.Checkpoint`, a path or a URI -> a location."""
    if isinstance(checkpoint, _Location):
        return checkpoint
    if hasattr(checkpoint, "filesystem") and hasattr(checkpoint, "path"):
        path = _absolute_if_local(checkpoint.filesystem, checkpoint.path)
        return _Location(checkpoint.filesystem, path, _uri_for(checkpoint.filesystem, path))
    from ray_jax_train import storage

    text = str(checkpoint)
    fs, path = _s3.known_filesystem(text) or storage.filesystem(text)
    return _Location(fs, path, _uri_for(fs, path))  # file:///x is /x to orbax, which read "file://" as a key


def _checkpoints_in(loc: _Location) -> List[str]:
    """Names of the finished checkpoints directly inside `loc`, oldest step first."""
    import pyarrow.fs as pafs

    try:
        entries = loc.filesystem.get_file_info(pafs.FileSelector(loc.fs_path, allow_not_found=True))
    except Exception:
        return []
    names = [e.base_name for e in entries if e.type == pafs.FileType.Directory and _NAME_RE.match(e.base_name)
             and TMP_SUFFIX not in e.base_name]
    return sorted(n for n in names if all(_exists(loc.child(n), f) for f in _finished_marks(loc)))


def _record_set_aside(run: _Location) -> bool:
    """Whether Ray's record of this run's checkpoints was set aside (unreadable, or naming one that is gone)."""
    import pyarrow.fs as pafs

    from ray_jax_train.trainer import RAY_SNAPSHOT

    try:
        entries = run.filesystem.get_file_info(pafs.FileSelector(run.fs_path, allow_not_found=True))
    except Exception:
        return True  # unknown: keep the checkpoints
    return any(e.base_name.startswith(RAY_SNAPSHOT + ".broken-") for e in entries)


def _step_of(loc: _Location) -> int:
    """The step in one of our checkpoints' names; -1 for any other name."""
    step = checkpoint_step(loc.fs_path)
    return -1 if step is None else step


def checkpoint_step(path: Optional[str]) -> Optional[int]:
    """The step in a checkpoint directory's name (`.../checkpoint_000000040_7e4178fe`), or None for another name."""
    match = _NAME_RE.match((path or "").rstrip("/").rsplit("/", 1)[-1].split("?", 1)[0])
    return int(match.group(1)) if match else None


def finished_after(run: _Location, latest: Optional[_Location]) -> List[_Location]:
    """Complete checkpoints in the run directory `run` saved after `latest` (Ray's latest), newest first: of a
    higher step and, when `latest` records its time, saved later (not an abandoned save of an earlier attempt that a
    later one, resuming from an older checkpoint, has since overtaken). Complete: every file a restore needs is
    there, checksums included when the save recorded them."""
    step, since = -1, None
    if latest is not None:
        step = _step_of(latest)
        try:
            since = float(_read_json(latest, META_FILE)["time"])
        except Exception:
            since = None
    found = []
    for name in reversed(_checkpoints_in(run)):
        loc = run.child(name)
        if _step_of(loc) <= step:
            break
        meta = _complete_meta(loc)
        try:
            if meta is not None and (since is None or float(meta.get("time", 0)) > since):
                found.append(loc)
        except (TypeError, ValueError):
            pass
    return found


def _complete_meta(loc: _Location) -> Optional[Dict[str, Any]]:
    """The metadata of one of our checkpoints when every file a restore needs is there (checksums too, when the
    save recorded them); None for a save cut short or a directory that is not ours."""
    try:
        meta = _read_json(loc, META_FILE)
        complete = meta.get("format") == FORMAT and _exists(loc, f"{STATE_ITEM}/_METADATA") and (
            meta.get("checksums") != CHECKSUMS_FILE or _exists(loc, CHECKSUMS_FILE))
    except Exception:
        return None
    return meta if complete else None


def _finished_marks(loc: _Location) -> Tuple[str, ...]:
    """Files a finished checkpoint has. On S3 and GCS a save writes under its final name from the start (orbax's
    commit-file scheme, no rename), so only its commit file, written last, tells a finished one from one a crash cut
    short."""
    commit_file = _s3.is_s3(loc.filesystem) or getattr(loc.filesystem, "type_name", "") == "gcs"
    return ("_CHECKPOINT_METADATA", "commit_success.txt") if commit_file else ("_CHECKPOINT_METADATA",)


def _is_file(loc: _Location) -> bool:
    import pyarrow.fs as pafs

    return loc.filesystem.get_file_info(loc.fs_path).type == pafs.FileType.File


def _exists(loc: _Location, relative: str = "") -> bool:
    import pyarrow.fs as pafs

    path = loc.fs_path if not relative else f"{loc.fs_path}/{relative}"
    return loc.filesystem.get_file_info(path).type != pafs.FileType.NotFound


def _read_json(loc: _Location, relative: str) -> Any:
    with loc.filesystem.open_input_stream(f"{loc.fs_path}/{relative}") as f:
        return json.loads(f.read().decode("utf-8"))


def _write_json(loc: _Location, relative: str, value: Any) -> None:
    with loc.filesystem.open_output_stream(f"{loc.fs_path}/{relative}") as f:
        f.write(json.dumps(value).encode("utf-8"))


# ------------------------------------------------------------------------------------------------------------
# Checksums
# ------------------------------------------------------------------------------------------------------------


def _unsigned_words(x):
    """The raw bits of an array as uint32 words (exact, for any dtype of 1 to 8 bytes)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = jnp.dtype(x.dtype).itemsize
    if size > 4:
        return lax.bitcast_convert_type(x, jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _checksum_leaf(x, offset, global_shape):
    """Three sums modulo 2**32 of the array's bits: exact, so independent of sharding and reduction order.

    The third mixes each word with its global position (`offset` is the shard's start in the global array): the
    first two only see which words there are, so swapped shards or a transposed array passed them unchanged.
    """
    import jax.numpy as jnp
    from jax import lax

    words = _unsigned_words(x)
    mixed = words * jnp.uint32(2654435761) + (words >> 16)
    extra = words.shape[x.ndim:]  # a word axis for 8-byte dtypes, the key data axis for PRNG keys
    shape = tuple(global_shape) + extra
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    where = jnp.zeros(words.shape, jnp.uint32)
    for d, stride in enumerate(strides):
        start = offset[d] if d < x.ndim else jnp.uint32(0)
        where = where + (lax.broadcasted_iota(jnp.uint32, words.shape, d) + start) * jnp.uint32(stride % (1 << 32))
    placed = (words ^ (where * jnp.uint32(0x9E3779B1))) * jnp.uint32(2246822519)
    placed = placed ^ (placed >> 13)
    return jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(mixed, dtype=jnp.uint32),
                      jnp.sum(placed, dtype=jnp.uint32)])


def _shard_offset(shard) -> np.ndarray:
    return np.asarray([s.start or 0 for s in shard.index], dtype=np.uint32)


def _checkable(leaf) -> bool:
    import jax

    if not isinstance(leaf, jax.Array) or leaf.size == 0:
        return False
    # An array that differs per process yet claims to be process-local has no global checksum.
    if jax.process_count() > 1 and leaf.is_fully_addressable and not leaf.is_fully_replicated:
        return False
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return True
    # Complex and sub-byte dtypes have no exact bit cast to words: not checked.
    return not jax.numpy.issubdtype(leaf.dtype, jax.numpy.complexfloating) and leaf.dtype.itemsize in (1, 2, 4, 8)


_checksum_jit = None


def _identity(x):
    return x


def _with_readable_shards(state):
    """`state` with every array's shards readable on this process.

    In a multi-process CPU job, `jax.device_put(<a jax.Array>, NamedSharding(mesh, P()))` makes an array that
    computes correctly under jit but whose `addressable_shards` raise "the input arrays must have one shard each"
    (JAX 0.10): a state built that way (or a key or frozen params kept out of the step) could not be saved. An
    identity jit, which needs no communication, gives the same values as a well-formed array."""
    import jax

    def readable(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            try:
                x.addressable_shards
            except ValueError:
                return jax.jit(_identity, out_shardings=x.sharding)(x)
        return x

    return jax.tree.map(readable, state)


def start_checksums(state, host_arrays: bool = False) -> Callable[[], List[Optional[List[int]]]]:
    """Dispatch this process's share of the checksums of `state` without waiting; returns a function that
    waits and gives them (`combine_checksums` adds the processes' shares into the global values).

    Each program sums one shard on its own device, with no collective: a cross-process collective launched
    here could run beside the step's or orbax's collectives, and on CPU (gloo) two collective programs in
    flight at once can deadlock the processes. Only a shard's first replica counts, so the shares add up
    to the whole array whatever the sharding. The step loop only enqueues the programs. `host_arrays`: numpy
    leaves are checked too, as whole arrays (a one-process restore into numpy, e.g. `restore(None, path)`).
    """
    import jax

    if host_arrays:
        state = jax.tree.map(lambda x: jax.device_put(x) if isinstance(x, np.ndarray) and x.size
                             and x.dtype.kind in "biuf" else x, state)

    global _checksum_jit
    if _checksum_jit is None:
        _checksum_jit = jax.jit(_checksum_leaf, static_argnums=2)
    pending = [[_checksum_jit(shard.data, jax.device_put(_shard_offset(shard), shard.device), tuple(leaf.shape))
                for shard in leaf.addressable_shards if shard.replica_id == 0]
               if _checkable(leaf) else None for leaf in jax.tree.leaves(state)]

    def result() -> List[Optional[List[int]]]:
        return [None if shards is None else _add_words([np.asarray(value).tolist() for value in shards])
                for shards in pending]

    return result


def _whole_copies(state) -> List[bool]:
    """Per leaf, whether this process holds the whole array on its own devices in a job of several processes."""
    import jax

    several = jax.process_count() > 1
    return [several and isinstance(x, jax.Array) and x.is_fully_addressable for x in jax.tree.leaves(state)]


def _add_words(parts: Sequence[Sequence[int]]) -> List[int]:
    return [int(sum(column)) % (1 << 32) for column in zip(*parts)] if parts else [0, 0, 0]


def combine_checksums(shares: Sequence[Sequence[Optional[Sequence[int]]]]) -> List[Optional[List[int]]]:
    """The global checksums from every process's `start_checksums` share (one list per process)."""
    return [None if leaf[0] is None else _add_words(leaf) for leaf in zip(*shares)]


def checksums(state) -> List[Optional[List[int]]]:
    """Per-leaf checksums of the global arrays of `state` (None for leaves that are not checked).

    Collective across processes (through the key-value store): every process calls it in the same order.
    """
    share = start_checksums(state)()
    return combine_checksums([json.loads(s) for s in _sync.allgather("checksums", json.dumps(share))])


# ------------------------------------------------------------------------------------------------------------
# Saving
# ------------------------------------------------------------------------------------------------------------


CHECKSUMS_FILE = "checksums.json"


def _temporary_path_class(loc: _Location):
    """Orbax's default for the location, except on S3: a commit file where its default renames a directory,
    which S3 cannot do (s3fs fails copying the directory's key). GCS gets the commit file by default."""
    if not _s3.is_s3(loc.filesystem):
        return None
    from orbax.checkpoint.path import atomicity

    return atomicity.CommitFileTemporaryPath


def _composite_handler(loc: Optional[_Location] = None):
    """The train state as an uncompressed orbax PyTree, plus a small JSON item of bookkeeping.

    Uncompressed because float weights and optimizer moments barely compress (zstd gained 9% here) while
    compressing costs CPU time that the step loop, sharing the host's cores, pays for.
    """
    import orbax.checkpoint as ocp

    temporary = None if loc is None else _temporary_path_class(loc)
    return ocp.CompositeCheckpointHandler(
        composite_options=ocp.CompositeOptions(temporary_path_class=temporary),
        **{STATE_ITEM: ocp.PyTreeCheckpointHandler(use_compression=False), META_ITEM: ocp.JsonCheckpointHandler()}
    )


_OWN_META_KEYS = ("format", "step", "data_state", "checksums", "process_count", "time")


def _check_json(name: str, value: Any) -> None:
    """Fail at once, on every worker, unless `value` comes back from JSON as it is (numpy numbers fail, and int
    keys and tuples came back as strings and lists: a resumed loop then read another position or none)."""
    try:
        back = json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise UsageTypeError(f"{name} must be JSON: {exc}. Convert numpy values with int()/float()/"
                             ".tolist().") from None
    if _json_types(back) == _json_types(value):
        return
    message = (f"{name}={value!r} does not survive JSON unchanged (it comes back as {back!r}): use str keys, lists "
               "instead of tuples, and plain int/float/str/bool/None values.")
    if _json_types(back) != _json_types(value, tuples_as_lists=True):
        raise UsageTypeError(message)
    logger.warning(message)  # only tuples, back as lists: most loops read them alike


def _json_types(value: Any, tuples_as_lists: bool = False):
    if isinstance(value, dict):
        return {k: _json_types(v, tuples_as_lists) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        kind = "list" if tuples_as_lists else type(value).__name__
        return [kind] + [_json_types(v, tuples_as_lists) for v in value]
    for kind in (bool, int, float, str, type(None)):  # np.float64 is a float, and comes back as one
        if isinstance(value, kind):
            return kind.__name__
    return type(value).__name__


def _brief(problem: str, limit: int = 300) -> str:
    """A restore problem without TensorStore's object dump ("See full TensorStore details: <bound method ..."),
    which says nothing a user can act on and pushed the rest of the message out of sight."""
    problem = problem.split(" See full TensorStore details", 1)[0]
    return problem if len(problem) <= limit else problem[:limit] + " ..."


def _checked_metadata(metadata: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """`metadata` as a dict, refused at construction (not at the first save, an hour in) if a save could not
    write it."""
    metadata = dict(metadata or {})
    taken = sorted(set(metadata) & set(_OWN_META_KEYS))
    if taken:
        raise UsageValueError(f"JaxCheckpointer(metadata=...) uses keys the checkpointer writes itself: {taken}; "
                              "rename them.")
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as exc:
        raise UsageValueError(f"JaxCheckpointer(metadata=...) must be JSON-serialisable: {exc}") from None
    return metadata


_TARGET_FIX = ("Build the target with rjt.abstract_state(state) from the state as placed on the mesh, or "
               "rjt.abstract_state(state, rjt.shardings_for(state, mesh, rules)), which give every leaf a "
               "NamedSharding over rjt.get_mesh() whose axes divide its shape (NamedSharding(mesh, PartitionSpec()) "
               "replicates a leaf)")


def _target_problem(target) -> Optional[str]:
    """What makes `target` one that no checkpoint can be read into, on this process, or None.

    Checked before any checkpoint is read: orbax's failure on such a leaf (jax's IndivisibleError, or "If the Array
    has no addressable shards, `dtype` must be provided") came back as a read failure of every checkpoint in turn,
    each logged as corrupt, and the run was told to start afresh (a review: two sound checkpoints)."""
    import jax

    from ray_jax_train.sharding import path_str

    bare, problems = [], []
    for path, leaf in jax.tree_util.tree_leaves_with_path(target):
        if not isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array)):
            continue  # numpy and Python values restore on the host
        sharding = leaf.sharding
        if sharding is None:
            bare.append(jax.tree_util.keystr(path))
            continue
        name = path_str(path) or "(the target itself)"
        shape = tuple(leaf.shape)
        try:
            sharding.shard_shape(shape)
        except Exception:  # jax's IndivisibleError, or a spec of more axes than the array has
            problems.append(f"{name} of shape {shape} cannot be split as its sharding {sharding} says (each "
                            "dimension must be a multiple of the number of shards along it); give it a "
                            "PartitionSpec whose mesh axes divide each dimension (PartitionSpec() replicates it)")
            continue
        mine = jax.process_index()
        if jax.process_count() > 1 and not any(d.process_index == mine for d in sharding.device_set):
            owners = sorted({d.process_index for d in sharding.device_set})
            # orbax builds each array from this process's shards: with none it fails ("If the Array has no
            # addressable shards, `dtype` must be provided"), on this process only.
            problems.append(
                f"{name} of shape {shape} has the sharding {sharding}, on devices of process"
                f"{'es' if len(owners) > 1 else ''} {', '.join(map(str, owners))} only, none of process {mine}'s, "
                "so this process has no shard to read it into. jax.devices()[0] is process 0's device on every "
                "worker (a single-device habit); each process's own devices are jax.local_devices(), and an array "
                "of the job is a NamedSharding over the mesh")
    if bare:
        problems.insert(0, (
            f"{', '.join(bare[:5])}{' ...' if len(bare) > 5 else ''} "
            f"{'is a ShapeDtypeStruct' if len(bare) == 1 else f'({len(bare)} leaves) are ShapeDtypeStructs'} with no "
            "sharding, which orbax would restore as numpy arrays on the host; give jax.ShapeDtypeStruct(shape, "
            "dtype, sharding=...), or a numpy array in the target for a leaf meant to stay on the host"))
    if not problems:
        return None
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return f"The restore target's {'; '.join(problems[:3])}{more}. {_TARGET_FIX}."


def _check_target(target, timeout_ms: int) -> None:
    """Raise `RestoreTargetError` on every process if the target is unusable on any (collective: a target on
    process 0's device fails on the others only, and a process raising alone would leave the rest waiting)."""
    problem = _target_problem(target) or ""
    problems = _sync.allgather("restore_target", problem, timeout_ms=timeout_ms)
    failed = [(p, v) for p, v in enumerate(problems) if v]
    if failed:
        where = "" if _sync.process_count() == 1 else f"On process {failed[0][0]}: "
        raise RestoreTargetError(where + failed[0][1])


def _plain_metrics(metrics: Dict[str, Any]) -> Dict[str, Any]:
    """Numbers as Python numbers: Ray's checkpoint manager serialises a checkpoint's metrics with pydantic, which
    failed on a numpy or JAX scalar (`loss=jnp.mean(...)`) in the controller, ending the run with "Unable to
    serialize unknown type" and leaving the saves unregistered. An array of more than one value is refused here,
    naming its key."""
    import jax

    def plain(key, value):
        if isinstance(value, (np.generic, np.ndarray, jax.Array)):
            if np.size(value) != 1:
                raise UsageTypeError(f"save(metrics=...): metrics[{key!r}] is an array of shape {np.shape(value)}; "
                                     "report numbers (e.g. float(x.mean())), and keep arrays in the state.")
            return np.asarray(value).item()
        return value

    return {key: plain(key, value) for key, value in metrics.items()}


def _check_savable(state) -> None:
    """Before orbax: a state with nothing to save, or with a leaf orbax has no handler for (a plain dataclass, an
    object of the user's), failed in orbax ("Found empty item", "TypeHandler lookup failed") and left a -tmp
    directory behind."""
    import jax

    from ray_jax_train.sharding import unregistered_class_hint

    leaves = jax.tree_util.tree_leaves_with_path(state)
    if not leaves:
        raise UsageValueError("save(): the state has no leaves to save (an empty dict, or only None). Pass the arrays "
                              "to checkpoint: params, optimizer state, step.")
    for path, leaf in leaves:
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, bool, str)):
            raise UsageValueError(  # ValueError, as orbax's own refusal was
                f"save(): the state's leaf {jax.tree_util.keystr(path) or '(the state itself)'} is a "
                f"{type(leaf).__module__}.{type(leaf).__qualname__}, which orbax cannot save. Make it a pytree "
                "(flax.struct.dataclass, jax.tree_util.register_dataclass, a NamedTuple) or save its fields in a "
                f"dict.{unregistered_class_hint(leaf)}")


def _host_digests(state) -> Dict[str, str]:
    """A digest of each host leaf (numpy, Python number or string) by path: what `_check_host_values_agree`
    compares across processes."""
    import hashlib

    import jax

    from ray_jax_train.sharding import array_digest

    digests = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if isinstance(leaf, (np.ndarray, np.generic)):
            if np.asarray(leaf).dtype.hasobject:
                continue  # compared by pointer it would always differ; orbax cannot save it anyway
            digests[jax.tree_util.keystr(path)] = array_digest(leaf)
        elif isinstance(leaf, (int, float, str)):
            digest = hashlib.sha1(repr(leaf + 0.0 if isinstance(leaf, float) else leaf).encode())
            digests[jax.tree_util.keystr(path)] = digest.hexdigest()[:16]
    return digests


def _check_host_values_agree(state, timeout_ms: int) -> None:
    """Host leaves are saved from process 0 alone and every process restores that copy: one that differs per
    worker (a numpy RNG per worker, a per-worker counter) came back as rank 0's on every worker, and the resumed
    run differed from an uninterrupted one without a word (a review: porting a pure-JAX loop). Collective: every
    process saves in the same order, so all of them raise together or none does."""
    if _sync.process_count() == 1:
        return
    mine = _host_digests(state)
    if not mine:
        return
    differ = _sync.keys_that_differ("host_values", mine, timeout_ms=timeout_ms)
    if differ:
        raise UsageValueError(
            f"save(): the state's host value{'s' if len(differ) > 1 else ''} {_sync.differ_between_processes(differ)}"
            ". A host leaf (numpy, a Python number or string) is saved from "
            "process 0 only, and every process would restore that copy. Keep per-worker values out of the saved "
            "state (derive a worker's random numbers from the seed, its rank and the step: "
            "np.random.default_rng([seed, rank, step]); a time or host name can go into the metrics instead), "
            "or agree on one value before saving (a sum or maximum over the workers), or make it a jax.Array "
            "placed on the mesh.")


class _PendingSave:
    def __init__(self, name: str, location: _Location, step: int, checksums=None, paths=None):
        self.name, self.location, self.step = name, location, step
        self.checksums = checksums  # a function giving the values, or None (not verified)
        self.paths = paths  # the leaves' paths, which the checksums file records next to the values
        self.done = threading.Event()
        self.error: Optional[BaseException] = None


def _as_saved(state, what: str = "state", host_values: str = "refuse"):
    """The tree orbax is given for `state` (to save, or as a restore target).

    An nnx Module or `nnx.Optimizer` becomes its `nnx.state`: orbax cannot read back the metadata of a Module
    pytree. In a job of several processes orbax's save refuses an array on this process's devices only: a scalar
    (`jnp.asarray(step)`, an optimizer's count) is kept as a host value, like a numpy leaf (process 0's is saved);
    anything bigger is refused (`host_values="refuse"`, for saves), naming the leaves and the fix, since each
    process may hold a different one. `"scalars"` converts the scalars only (`abstract_state`: the target of such a
    save); `"keep"` leaves them (restore targets: orbax restores into host-local shardings)."""
    import jax

    from ray_jax_train.sharding import _is_nnx_object

    if any(_is_nnx_object(x) for x in jax.tree.leaves(state, is_leaf=_is_nnx_object)):
        from flax import nnx

        state = jax.tree.map(lambda x: nnx.state(x) if _is_nnx_object(x) else x, state, is_leaf=_is_nnx_object)
    if jax.process_count() == 1 or host_values == "keep":
        return state
    local = []

    def host(path, x):
        sharding = getattr(x, "sharding", None)
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and sharding is not None \
                and sharding.is_fully_addressable:
            if len(x.shape) == 0 and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                return np.asarray(x) if isinstance(x, jax.Array) else np.zeros((), x.dtype)
            local.append(f"{jax.tree_util.keystr(path)} {tuple(x.shape)}")
        return x

    state = jax.tree_util.tree_map_with_path(host, state)
    if local and host_values == "refuse":
        raise UsageValueError(
            f"The {what}'s {', '.join(local[:5])}{' ...' if len(local) > 5 else ''} "
            f"{'lives' if len(local) == 1 else f'({len(local)} leaves) live'} on this process's devices only, in a "
            f"job of {jax.process_count()} processes, where each process may hold a different one. Place the state "
            "on the mesh first: rjt.shard_by_rules(state, mesh, rules) (it also takes nnx Modules and Optimizers, in "
            "place; rules=[(r'.*', PartitionSpec())] replicates every leaf, for data parallel), or jax.jit(init, out_shardings=rjt.shardings_for(...)); a leaf meant to stay on the host can "
            "be a numpy array (process 0's copy is saved).")
    return state


def abstract_state(state, shardings=None):
    """`jax.ShapeDtypeStruct`s (with shardings) for `state`, the target `restore` fills.

    `shardings`, a matching pytree of `Sharding`s, moves the target onto a different mesh (elastic resume).
    numpy leaves without a sharding stay as they are: they restore as numpy, on the host; so do Python numbers
    and strings (a step counter kept as an int, a run tag), whose values are their own target. An nnx Module or
    Optimizer stands for its `nnx.state`, which restore gives back: `nnx.update(model, restored.state)`.
    """
    import jax

    from ray_jax_train.sharding import unregistered_class_hint

    # The target of a save that kept host scalars as numpy; given shardings place every leaf themselves.
    state = _as_saved(state, "state", host_values="scalars" if shardings is None else "keep")

    def one(path, leaf, sharding=None):
        if isinstance(leaf, (int, float, str)) and not isinstance(leaf, np.generic):  # bool is an int
            return leaf  # a Python scalar restores as what it is
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise UsageTypeError(f"abstract_state: the state's leaf {jax.tree_util.keystr(path)} is a "
                                 f"{type(leaf).__module__}.{type(leaf).__qualname__}, not an array, number or string, "
                                 "so it has no shape and dtype to restore into (nor could it have been saved). Make "
                                 "it a pytree of arrays (flax.struct.dataclass, a NamedTuple), or restore(None, ...) "
                                 f"to read the state as saved.{unregistered_class_hint(leaf)}")
        sharding = sharding if sharding is not None else getattr(leaf, "sharding", None)
        if sharding is None and isinstance(leaf, (np.ndarray, np.generic)):
            return leaf  # a host value (a numpy RNG state, say): restored as numpy, as it was saved
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    if shardings is None:
        return jax.tree_util.tree_map_with_path(one, state)
    return jax.tree_util.tree_map_with_path(one, state, shardings)


_restore_called_in_process = False  # by any checkpointer: a loop may restore through another than it saves with
_saved_in_process = False  # by any checkpointer: its save may be in flight when another one restores


class _OrbaxInfoFilter(logging.Filter):
    """Drops the INFO lines that orbax logs through absl's logger (so an "orbax" logger level misses them); other
    absl INFO lines stay. Told by the calling frames, not the record's file: in a Ray worker absl's records name
    absl's own file as their origin."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        frame = sys._getframe(1)
        while frame is not None:
            if _ORBAX_DIR in frame.f_code.co_filename:
                return False
            frame = frame.f_back
        return True

    def install(self, on: bool) -> None:
        absl_logger = logging.getLogger("absl")
        if on and self not in absl_logger.filters:
            absl_logger.addFilter(self)
        elif not on:
            absl_logger.removeFilter(self)


_ORBAX_DIR = f"{os.sep}orbax{os.sep}"
_orbax_info_filter = _OrbaxInfoFilter()


# This process's checkpointers, for `finish_saves_in_flight` (weakly: a loop's own goes when the loop ends).
_checkpointers: "weakref.WeakSet[JaxCheckpointer]" = weakref.WeakSet()

SAVE_ON_ERROR_WAIT = "RAY_JAX_TRAIN_SAVE_ON_ERROR_WAIT_S"


def finish_saves_in_flight() -> None:
    """Let this process's asynchronous saves finish before an error it raises ends the worker group.

    An error ends every worker at once, and a save that `save()` had returned from was still committing on the
    others: it was deleted as unfinished on restart, and the run resumed from the save before (3 runs in 5, a
    review; TorchTrainer's synchronous report never loses one). Waited for in a thread, at most
    `RAY_JAX_TRAIN_SAVE_ON_ERROR_WAIT_S` (120 s) in all, since a save whose peers are gone never finishes.
    """
    pending = [(c, c._pending) for c in list(_checkpointers) if c._pending is not None and not c._pending.done.is_set()]
    if not pending:
        return
    try:
        limit = float(os.environ.get(SAVE_ON_ERROR_WAIT, "120"))
    except ValueError:
        limit = 120.0
    logger.warning("An error ends this worker with the save of step %s in flight: waiting up to %g s for it to "
                   "finish, so the run can resume from it.", ", ".join(str(p.step) for _, p in pending), limit)

    def finish():
        for checkpointer, save in pending:
            try:
                with checkpointer._lock:  # Ray's upload thread may be finishing it already: then this waits
                    if checkpointer._pending is save:
                        checkpointer._finish_pending()
            except BaseException as exc:  # noqa: BLE001 - the loop's own error is the one to raise
                logger.warning("The save of step %d did not finish: %s", save.step, exc)

    waiter = threading.Thread(target=finish, name="ray_jax_train-finish-saves", daemon=True)
    waiter.start()
    waiter.join(limit)
    if waiter.is_alive():
        logger.warning("The save in flight did not finish within %g s; the run resumes from an earlier one.", limit)


class JaxCheckpointer:
    """Saves and restores the whole train state from inside a `JaxTrainer` loop.

    One instance per loop. Every call is collective: all workers call it with the same arguments in the
    same order.

        ckpt = JaxCheckpointer(save_every=50)
        restored = ckpt.restore(abstract_state(state))
        step = 0 if restored is None else restored.step
        state = state if restored is None else restored.state
        while step < steps:
            state = train_step(state, next(batches)); step += 1
            ckpt.maybe_save(step, state, metrics=lambda: {"loss": float(loss)}, data_state={...})
        ckpt.close()

    A save reports to Ray itself, with `metrics`: a loop that also calls `ray.train.report` at that step makes two
    reports of one step (Tune and Ray's scoring see both; `Result.metrics` is the checkpoint's). Report on the
    other steps only, or pass everything in `metrics`.

    Args:
        save_every: save when `step % save_every == 0` in `maybe_save` (None: only explicit or preemption saves).
        async_save: write in the background while training goes on (False: each save blocks until on disk).
        verify: record per-array checksums and check them on restore.
        handle_preemption: react to Ray's preemption notice (`ray.train.get_preemption_info`) and to SIGTERM
            with a checkpoint, checked every `preemption_check_every` steps in `maybe_save` (each check is
            a small cross-worker agreement, so not every step).
        exit_after_sigterm_save: after the SIGTERM checkpoint is registered, let the SIGTERM end the worker
            (Ray then restarts the group from that checkpoint). False keeps training until killed.
        sigterm_grace_s: after a SIGTERM, exit anyway if no checkpoint was saved within this time.
        timeout_s: how long a worker waits for the others: for the slowest reader of a restore, the slowest
            writer of a save, and Ray's list of checkpoints. Raise it for states that take longer to read or write.
        metadata: JSON-serialisable facts saved with every checkpoint, inside its atomic commit, and given back in
            `Restored.metadata` (the LM loop keeps the model's config there, so each checkpoint exports with the
            config it was trained with).
        orbax_info_logs: show orbax's INFO lines (about 15 per save on every worker: handlers, registries,
            barriers), which it logs through absl's logger; off by default (absl's INFO lines off in this worker),
            warnings and errors always show.
    """

    def __init__(
        self,
        save_every: Optional[int] = None,
        *,
        async_save: bool = True,
        verify: bool = True,
        handle_preemption: bool = True,
        preemption_check_every: int = 10,
        exit_after_sigterm_save: bool = True,
        sigterm_grace_s: float = 120.0,
        timeout_s: float = 600.0,
        metadata: Optional[Mapping[str, Any]] = None,
        orbax_info_logs: bool = False,
    ):
        if save_every is not None and (not isinstance(save_every, int) or save_every < 1):
            raise UsageValueError(f"save_every={save_every!r} must be a positive integer or None.")
        if not isinstance(preemption_check_every, int) or preemption_check_every < 1:
            raise UsageValueError(f"preemption_check_every={preemption_check_every!r} must be a positive integer.")
        self.metadata = _checked_metadata(metadata)
        self.save_every = save_every
        self.async_save = async_save
        self.verify = verify
        self.handle_preemption = handle_preemption
        self.preemption_check_every = preemption_check_every
        self.exit_after_sigterm_save = exit_after_sigterm_save
        self.timeout_s = timeout_s
        self._timeout_ms = int(timeout_s * 1000)
        self._orbax = None
        self._lock = threading.Lock()
        self._pending: Optional[_PendingSave] = None
        self._token: Optional[str] = None
        self._last_saved_step: Optional[int] = None
        self._restore_called = False
        self._adopted: List[_Location] = []  # finished saves Ray never registered, restored from; not Ray's to delete
        self._ray_preemption_saved = False
        self._location: Optional[_Location] = None
        self._storage_checked = False
        if handle_preemption:
            signals.install_sigterm_handler(sigterm_grace_s)
        _orbax_info_filter.install(not orbax_info_logs)
        _checkpointers.add(self)

    # -- plumbing ---------------------------------------------------------------------------------------------

    @property
    def location(self) -> _Location:
        if self._location is None:
            self._location = _run_location()
        return self._location

    def _check_shared_storage(self) -> None:
        """Once, collectively: every process must see the run directory that process 0 writes in.

        A node-local storage_path on a multi-node cluster would split each checkpoint over the nodes' disks:
        saves look fine, and the first restore after losing a node finds half a checkpoint. Ray's own check
        for this never runs, since our checkpoints reach storage without Ray's upload.
        """
        if self._storage_checked:
            return
        self._storage_checked = True
        import os

        import pyarrow.fs as pafs
        import ray.train

        workers = ray.train.get_context().get_world_size()
        if _sync.process_count() != workers:
            # With JaxConfig(distributed=False) every worker would save alone, all into one directory.
            raise RuntimeError(
                f"JaxCheckpointer needs the {workers} workers to be one jax.distributed job, but this one has "
                f"{_sync.process_count()} process(es). Leave JaxConfig(distributed=True) (the default) for its "
                "checkpoints, or save per-worker state with ray.train.report yourself.")

        from ray_jax_train import storage

        loc = self.location
        if _sync.process_count() == 1 or not isinstance(loc.filesystem, pafs.LocalFileSystem):
            return
        marker, token = os.path.join(loc.fs_path, storage.MARKER_NAME), ""
        if _sync.process_index() == 0:
            try:
                marker, token = storage.write_marker(loc.fs_path)
            except OSError as exc:  # shared, so the others fail with the cause instead of waiting for a token
                token = f"!process 0 cannot write in the run directory {loc.fs_path}: {exc}"
        token = _sync.broadcast("storage-token", token, timeout_ms=self._timeout_ms)
        if token.startswith("!"):
            raise StorageNotSharedError(token[1:])
        problem = storage.marker_problem(marker, token)
        for _ in range(5):  # NFS may cache a directory's listing for a moment: read again before calling it missing
            if problem is None:
                break
            time.sleep(0.2)
            problem = storage.marker_problem(marker, token)
        problems = _sync.allgather("storage", problem or "", timeout_ms=self._timeout_ms)
        bad = [f"process {i}: {problem}" for i, problem in enumerate(problems) if problem]
        if bad:
            raise StorageNotSharedError("; ".join(bad))

    def _checkpointer(self):
        if self._orbax is None:
            import orbax.checkpoint as ocp

            self._orbax = ocp.AsyncCheckpointer(_composite_handler(self.location),
                                                temporary_path_class=_temporary_path_class(self.location))
        return self._orbax

    def _name(self, step: int) -> str:
        if self._token is None:
            self._token = _sync.broadcast("token", secrets.token_hex(4), timeout_ms=self._timeout_ms)
        return f"checkpoint_{step:09d}_{self._token}"

    def _finish_pending(self) -> None:
        """Wait for the save in flight, if any. Caller holds the lock."""
        pending = self._pending
        if pending is None or pending.done.is_set():
            return
        try:
            self._checkpointer().wait_until_finished()
            if pending.checksums is not None:
                # Read here, off the step loop. Keyed by the checkpoint's name, not by call order, because
                # this may run in Ray's upload thread while the step loop agrees on other things.
                shares = _sync.allgather("checksums", json.dumps(pending.checksums()),
                                         key=f"checksums/{pending.name}", timeout_ms=self._timeout_ms)
                if _sync.process_index() == 0:
                    values = combine_checksums([json.loads(s) for s in shares])
                    _write_json(pending.location, CHECKSUMS_FILE, {"paths": pending.paths, "values": values})
                # Done on every process only once process 0 has written them: a worker that then raises, ending
                # the group, leaves a complete save behind (one a restart adopts), not one without its checksums.
                _sync.allgather("checksums_written", "", key=f"checksums_written/{pending.name}",
                                timeout_ms=self._timeout_ms)
        except BaseException as exc:
            pending.error = exc
            raise
        finally:
            pending.done.set()

    def _drop_adopted_before(self, step: int) -> None:
        """Delete the adopted checkpoints older than a save now complete, or than the one restored: Ray's retention
        never sees them, and a stop from here on finds the newer one to adopt instead. (Workers stopped by Ctrl-C
        save on for a moment; with a save every step a run kept 11 such checkpoints past checkpoints_to_keep.)"""
        older = [loc for loc in self._adopted if _step_of(loc) < step]
        self._adopted = [loc for loc in self._adopted if _step_of(loc) >= step]
        if _sync.process_index() != 0:
            return
        for loc in older:
            logger.info("Removing %s (adopted, never registered, now superseded by step %d).", loc.fs_path, step)
            try:
                loc.filesystem.delete_dir(loc.fs_path)
            except Exception as exc:
                logger.warning("Could not remove %s: %s", loc.fs_path, exc)

    def _await_commit(self, pending: _PendingSave):
        """Ray's "upload" function: copy nothing, wait until orbax has committed this save."""

        def upload(checkpoint, _dir_name):
            if not pending.done.is_set():
                with self._lock:
                    if self._pending is pending:
                        self._finish_pending()
            pending.done.wait()
            if pending.error is not None:
                raise RuntimeError(f"Checkpoint save to {pending.location.uri} failed: {pending.error}") from pending.error
            if _sync.process_index() == 0 and not _exists(pending.location, "_CHECKPOINT_METADATA"):
                raise CheckpointCorruptError(f"Orbax reported {pending.location.uri} committed, but it is not there.")
            if _sync.process_index() == 0 and pending.checksums is not None and not _exists(pending.location, CHECKSUMS_FILE):
                raise CheckpointCorruptError(f"{pending.location.uri} has no {CHECKSUMS_FILE} after its save finished.")
            # Checked complete, so a stop from here on finds this save to adopt in place of the older ones.
            self._drop_adopted_before(pending.step)
            return checkpoint

        return upload

    # -- saving -----------------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state,
        *,
        metrics: Union[None, Mapping[str, Any], Callable[[], Mapping[str, Any]]] = None,
        data_state: Any = None,
        wait: bool = False,
        validation: Any = False,
    ) -> str:
        """Start saving `state` as of `step` and report it to Ray once it is on storage. Returns its path.

        `metrics` (a dict, or a function returning one so a host sync happens only on save steps) are reported
        with the checkpoint, with `step` set to this one, so `CheckpointConfig(checkpoint_score_attribute=...)` can use
        them. `data_state` is any JSON-serialisable position of the input pipeline (or a function returning one,
        called after `metrics`: what it holds may come from that sync). `wait=True` blocks until
        Ray has registered the checkpoint. `validation` goes to `ray.train.report`: True (or a
        `ray.train.ValidationTaskConfig`) runs the trainer's `validation_config` function on this checkpoint.
        An nnx Module or Optimizer in `state` is saved as its `nnx.state` (see `abstract_state`).
        """
        import jax
        import orbax.checkpoint as ocp
        import ray.train
        from ray.train import Checkpoint
        from ray.train.v2.api.report_config import CheckpointUploadMode

        step = int(step)
        self._check_shared_storage()
        metrics = _plain_metrics(dict(metrics() if callable(metrics) else (metrics or {})))
        if metrics.get("step", step) != step:
            logger.warning("save(step=%d) reports metrics['step'] as %d, the checkpoint's own step (restores order "
                           "checkpoints by it); the metrics' own 'step' (%r) is replaced. Report yours under "
                           "another name.", step, step, metrics["step"])
        metrics["step"] = step  # the checkpoint's own step, which restores order candidates by, not a logged one
        if callable(data_state):
            data_state = data_state()
        if self._last_saved_step == step:
            logger.info("Step %d is already checkpointed; not saving it twice.", step)
            if wait:
                self.wait(registered=True)
            return self.location.child(self._name(step)).uri
        if self._last_saved_step is None and not (self._restore_called or _restore_called_in_process):
            self._warn_if_starting_over(step)
        name = self._name(step)
        location = self.location.child(name)
        meta = {
            **self.metadata,
            "format": FORMAT,
            "step": step,
            "data_state": data_state,
            "checksums": CHECKSUMS_FILE if self.verify else None,
            "process_count": _sync.process_count(),
            "time": time.time(),
        }
        _check_json("data_state", data_state)
        state = _with_readable_shards(_as_saved(state))
        _check_savable(state)
        _check_host_values_agree(state, self._timeout_ms)
        pending = _PendingSave(name, location, step, start_checksums(state) if self.verify else None,
                               leaf_paths(state))
        # Orbax opens a save with a barrier that is a device collective; it must not run beside a step still
        # in flight (two collective programs at once can deadlock gloo). Orbax copies the arrays to host
        # before returning anyway, so waiting for them here costs nothing.
        jax.block_until_ready(state)
        with self._lock, orbax_guard.unchecked():
            self._finish_pending()
            self._checkpointer().save(
                location.uri,
                args=ocp.args.Composite(
                    **{STATE_ITEM: ocp.args.PyTreeSave(state), META_ITEM: ocp.args.JsonSave(meta)}
                ),
            )
            # Only a save orbax took is in flight: one it refused, left pending, made every later save, wait and
            # close fail, and wrote its checksums over a checkpoint already there under its name.
            self._pending = pending
        global _saved_in_process
        self._last_saved_step, _saved_in_process = step, True
        ray.train.report(
            metrics,
            checkpoint=Checkpoint(path=location.fs_path, filesystem=location.filesystem),
            checkpoint_dir_name=name,
            checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
            delete_local_checkpoint_after_upload=False,
            checkpoint_upload_fn=self._await_commit(pending),
            **({"validation": validation} if validation else {}),
        )
        if wait or not self.async_save:
            self.wait(registered=wait)
        return location.uri

    @staticmethod
    def _warn_if_starting_over(step: int) -> None:
        """A loop that never calls restore() trains again from its start after every restart, silently, and
        saves the same steps again beside the old ones."""
        import ray.train

        latest = ray.train.get_checkpoint()
        if latest is not None and 0 <= step <= _step_of(_location_of(latest)):
            logger.warning(
                "Saving step %d, but this run already has a checkpoint of step %d (%s) and restore() was not "
                "called: the loop started over instead of resuming. Call JaxCheckpointer.restore(abstract_state("
                "state)) (or ray_jax_train.checkpoint.restore) before the loop, and start at the step it returns.",
                step, _step_of(_location_of(latest)), latest.path)

    def should_save(self, step: int) -> Tuple[bool, str]:
        """(save now?, why): a preemption notice/SIGTERM agreed across workers, or periodic.

        The preemption check runs on its steps even when they are periodic save steps too: skipped there, a
        `save_every` that divides `preemption_check_every` never saw a SIGTERM, and the grace timer killed the
        worker at a random moment. A periodic save on such a step is then the preemption save (waited for)."""
        if self.handle_preemption and step % self.preemption_check_every == 0:
            save, why = self._preemption_requested()
            if save:
                return save, why
        if self.save_every and step % self.save_every == 0:
            return True, "periodic"
        return False, ""

    def _preemption_requested(self) -> Tuple[bool, str]:
        import ray.train

        flags = _sync.allgather("sigterm", "1" if signals.sigterm_received() else "0", timeout_ms=self._timeout_ms)
        if "1" in flags:
            return True, "sigterm"
        if self._ray_preemption_saved:
            return False, ""
        try:
            info = ray.train.get_preemption_info()
        except Exception as exc:  # an older Ray or no watcher: SIGTERM is then the only notice
            logger.debug("ray.train.get_preemption_info() unavailable: %s", exc)
            info = None
        if info is not None:
            self._ray_preemption_saved = True
            deadline = f" (deadline in {info.deadline_ms / 1000 - time.time():.0f}s)" if info.deadline_ms else ""
            logger.warning("Preemption notice for ranks %s%s: saving a checkpoint.", info.preempted_ranks, deadline)
            return True, "preemption"
        return False, ""

    def maybe_save(
        self,
        step: int,
        state,
        *,
        metrics: Union[None, Mapping[str, Any], Callable[[], Mapping[str, Any]]] = None,
        data_state: Any = None,
        validation: Any = False,
        final: bool = False,
    ) -> bool:
        """Call once per step (after the step): saves when `should_save(step)`. Returns whether it saved.
        `validation` is passed to `save` on the steps that save. `final=True` on the loop's last step: that step is
        saved whether or not it is a `save_every` step (with `save_every` unset only a preemption saves, as on
        any step), and a SIGTERM saved there lets the loop finish (the run ends done) instead of ending the worker,
        which failed a run that had trained to the end (a failure-injection review)."""
        signals.maybe_inject_fault(step)
        save, why = self.should_save(step)
        if not save and final and self.save_every:
            # The last step is the one a run is resumed or exported from: with save_every=5 and 12 steps the run's
            # last checkpoint was step 10, and final=True read (as orbax's `force`, or a torch loop's last report)
            # as "keep this step" lost the last 2 (a review).
            save, why = True, "final"
        if not save:
            return False
        preempted = why in ("sigterm", "preemption")
        self.save(step, state, metrics=metrics, data_state=data_state, wait=preempted, validation=validation)
        if why == "sigterm" and signals.sigterm_received():
            if self.exit_after_sigterm_save and not final:
                logger.warning("Checkpoint for step %d registered after SIGTERM; exiting this worker.", step)
                signals.release_sigterm()
            else:
                signals.sigterm_handled()
        return True

    def wait(self, registered: bool = False) -> None:
        """Block until the save in flight is on storage (and, with `registered`, until Ray has registered it)."""
        with self._lock:
            self._finish_pending()
            pending = self._pending
        if registered:
            import ray.train
            from ray.train.v2.api.report_config import CheckpointConsistencyMode

            # Ray returns its list when its timeout passes, registered or not; a worker released then (after a
            # SIGTERM) let the next incarnation delete the save as an orphan. So ask until it is there.
            waited = time.monotonic()
            while True:
                reported = ray.train.get_all_reported_checkpoints(
                    consistency_mode=CheckpointConsistencyMode.COMMITTED, timeout_s=self.timeout_s)
                names = {r.checkpoint.path.rstrip("/").rsplit("/", 1)[-1] for r in reported}
                if pending is None or pending.name in names:
                    break
                logger.warning("Checkpoint %s is not registered with Ray after %.0f s; still waiting.",
                               pending.name, time.monotonic() - waited)

    def close(self) -> None:
        """Wait for the last save (Ray also waits for it before the worker finishes); SIGTERM is ordinary again.

        A SIGTERM still pending ends this process right after: first Ray must have registered the last save, or
        the restarted run would find it unregistered and delete it as an orphan.
        """
        self.wait(registered=signals.sigterm_received() and self._last_saved_step is not None)
        signals.deactivate_sigterm_handler()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()

    # -- restoring --------------------------------------------------------------------------------------------

    def has_resume_point(self) -> bool:
        """Whether `restore()` (no checkpoint given) may find a state: Ray's latest checkpoint, or a finished save
        Ray never registered, which restore adopts. A loop asks before it opens its data: it opened at the data's
        start when Ray had none, and the adopted state then trained from step 10 on the batches of step 0 (a
        review: 30 of 40 losses off). One answer on every process, as their listings could differ."""
        import ray.train

        if ray.train.get_checkpoint() is not None:
            return True
        try:
            mine = bool(finished_after(self.location, None))
        except Exception as exc:  # noqa: BLE001 - storage out of reach: restore says so itself
            logger.debug("Could not list %s: %s", self.location.fs_path, exc)
            mine = True  # asked again by restore; opening the data late costs only the overlap
        return "1" in _sync.allgather("has_resume_point", "1" if mine else "0")

    def restore(self, target, checkpoint=None, *, fallback: bool = True, cleanup: bool = True,
                partial: bool = False) -> Optional[Restored]:
        """Restore into `target` (a pytree of `jax.ShapeDtypeStruct` with shardings, see `abstract_state`).

        Source: `checkpoint` (a `ray.train.Checkpoint`, path or URI) if given, else the run's latest checkpoint
        (`ray.train.get_checkpoint()`); None when there is none (a fresh start). Arrays are read straight
        into their target shardings, so the target may be on a different mesh or number of workers than the
        saving run. If the latest checkpoint is corrupt or partial, the previous reported ones are tried,
        newest first (`fallback`). `cleanup` removes, on a fresh incarnation, orbax temporary directories and
        checkpoint directories Ray never registered (left by a worker that died mid-save); a finished one newer
        than every registered checkpoint (its run stopped before Ray registered it) is restored from instead. `partial=True` reads
        only the arrays `target` names (e.g. `{"params": ...}` out of a whole train state). `target=None` reads the
        whole state as saved, as numpy arrays on the host (nested dicts; on the driver, without rebuilding the
        model or optimizer that made it), verified against the recorded checksums in a one-process job; a typed
        PRNG key comes back as its uint32 key data there (`jax.random.wrap_key_data(x, impl=...)` makes it a key).
        """
        import jax

        global _restore_called_in_process
        if target is not None:
            target = _as_saved(target, "restore target", host_values="keep")
            # orbax restores into a 0-d array, not into a numpy scalar ("Unsupported type", read as corrupt).
            target = jax.tree.map(lambda x: np.asarray(x) if isinstance(x, np.generic) else x, target)
            _check_target(target, self._timeout_ms)
        self._restore_called = _restore_called_in_process = True
        restored = self._restore(target, checkpoint, fallback=fallback, cleanup=cleanup, partial=partial)
        if restored is not None and self._last_saved_step is not None:
            # A mid-run rollback: the steps after it are saved again, as new checkpoints. With the old name token a
            # step saved before was "already checkpointed" (its old state kept) or collided with its directory.
            with self._lock:
                self._finish_pending()
            self._last_saved_step, self._token = None, None
        return restored

    def _restore(self, target, checkpoint, *, fallback: bool, cleanup: bool, partial: bool) -> Optional[Restored]:
        import ray.train

        if checkpoint is not None:
            return self._restore_first([_location_of(checkpoint)], target, explicit=True, partial=partial)
        try:
            ray.train.get_context()
        except RuntimeError:  # Ray's message says where not to call it, not what to do instead
            raise UsageValueError("restore() without a checkpoint restores the run's latest, which only the training "
                                  "workers know. Outside them (on the driver after fit(), say) pass the checkpoint: "
                                  "restore(target, result.checkpoint) or a checkpoint path.") from None
        self._check_shared_storage()
        latest = ray.train.get_checkpoint()
        # Clean up only before this checkpointer's first save: later (a mid-run rollback) a save of its own may
        # still be on its way to Ray, and Ray's list, cut short by its timeout, would not show it.
        # In this process at all: a rollback may restore through another checkpointer than the one that saves, and
        # Ray's list, cut at its timeout, misses that one's save in flight (a deletion-safety review).
        cleanup = cleanup and self._pending is None and self._last_saved_step is None and not _saved_in_process
        reported = self._reported_locations() if (fallback or cleanup) else []
        known = (reported or []) + ([_location_of(latest)] if latest is not None else [])
        # Only with Ray's list in hand: without it every registered checkpoint would look unregistered.
        adopted = []
        if cleanup and reported is not None:
            adopted = self._finished_unregistered(known)
            # With Ray's record set aside (trainer.set_aside_a_broken_checkpoint_snapshot) Ray knows none, and the
            # complete checkpoints are ones it had registered, the best-scoring among them: restored from, never
            # deleted as superseded (they were, every one but the newest: a deletion-safety review).
            self._adopted = adopted if known or not _record_set_aside(self.location) else []
            if _sync.process_index() == 0:
                self._remove_orphans(known + adopted)
        candidates = [] if latest is None else [_location_of(latest)]
        if fallback and candidates:
            candidates += [loc for loc in (reported or []) if loc.fs_path != candidates[0].fs_path]
        # Without fallback too, Ray's latest stays behind an adopted save: it was the answer before adoption.
        candidates = (adopted if fallback else adopted[:1]) + candidates
        candidates = self._agree_on(candidates, listed=reported is not None)
        if not candidates:
            return None
        restored = self._restore_first(candidates, target, explicit=False, partial=partial)
        self._drop_adopted_before(restored.step)
        return restored

    def _agree_on(self, candidates: List[_Location], listed: bool) -> List[_Location]:
        """One candidate list on every process: the first whose query to Ray succeeded (`listed`). A process
        walking a shorter list would give up while the others fall back, and leave them waiting."""
        mine = json.dumps([listed, [c.uri for c in candidates]])
        lists = [json.loads(v) for v in _sync.allgather("candidates", mine, timeout_ms=self._timeout_ms)]
        uris = next((uris for ok, uris in lists if ok), lists[0][1])
        mine = {loc.uri: loc for loc in candidates}
        return [mine[uri] if uri in mine else _location_of(uri) for uri in uris]

    def _reported_locations(self) -> Optional[List[_Location]]:
        """Ray's registered checkpoints, newest (highest step) first; None if Ray could not be asked."""
        import ray.train
        from ray.train.v2.api.report_config import CheckpointConsistencyMode

        try:
            reported = ray.train.get_all_reported_checkpoints(
                consistency_mode=CheckpointConsistencyMode.COMMITTED, timeout_s=self.timeout_s
            )
        except Exception as exc:
            logger.warning("Could not list the run's reported checkpoints (%s); no fallback available.", exc)
            return None

        def order(item):
            step = (item.metrics or {}).get("step")
            match = _NAME_RE.match(item.checkpoint.path.rstrip("/").rsplit("/", 1)[-1])
            return int(step) if step is not None else (int(match.group(1)) if match else -1)

        return [_location_of(r.checkpoint) for r in sorted(reported, key=order, reverse=True)]

    def _finished_unregistered(self, known: Sequence[_Location]) -> List[_Location]:
        """Finished checkpoints newer than any Ray registered, newest first: saves of a run stopped between
        their commit and Ray's registration (`ray job stop` ends the driver, and with it Ray's controller, while
        the workers' saves complete). Complete and checksummed, they are the run's latest progress; deleting them
        as orphans lost up to `save_every` steps."""
        adopted = finished_after(self.location, max(known, key=_step_of, default=None))
        if adopted and _sync.process_index() == 0:
            logger.warning(
                "Found %d finished checkpoint(s) newer than the last one Ray registered (the run stopped between a "
                "save and its registration); resuming from the newest, %s.", len(adopted), adopted[0].uri)
        return adopted

    def _remove_orphans(self, keep: Sequence[_Location]) -> None:
        """Delete our checkpoint directories that Ray does not track, and orbax temporaries (process 0 only)."""
        import pyarrow.fs as pafs

        root = self.location
        keep_names = {loc.fs_path.rstrip("/").rsplit("/", 1)[-1] for loc in keep}
        # Only where Ray's record was set aside are untracked complete checkpoints ones Ray had registered. Else they
        # are Ray's rotated-out ones whose deletion a crash cut off, or adopted ones a crash kept: deleted as before.
        set_aside = _record_set_aside(root)
        try:
            entries = root.filesystem.get_file_info(pafs.FileSelector(root.fs_path, allow_not_found=True))
        except Exception as exc:
            logger.warning("Could not list %s for cleanup: %s", root.fs_path, exc)
            return
        for info in entries:
            if info.type != pafs.FileType.Directory:
                continue
            base = info.base_name
            stale_tmp = TMP_SUFFIX in base and _NAME_RE.match(base.split(TMP_SUFFIX)[0])
            orphan = _NAME_RE.match(base) and base not in keep_names
            if orphan and set_aside and _complete_meta(root.child(base)) is not None:
                # Complete, and registered with Ray before its record was set aside: maybe the run's best.
                logger.info("Keeping %s: a complete checkpoint Ray registered before its record was set aside "
                            "(checkpoints_to_keep no longer applies to it); delete it by hand if it is not wanted.",
                            info.path)
                continue
            if stale_tmp or orphan:
                logger.info("Removing %s (%s).", info.path, "unfinished save" if stale_tmp else "never registered")
                try:
                    root.filesystem.delete_dir(info.path)
                except Exception as exc:
                    logger.warning("Could not remove %s: %s", info.path, exc)

    def _restore_first(self, candidates: List[_Location], target, explicit: bool, partial: bool = False) -> Restored:
        problems = []
        read_failures = []  # per candidate: its processes' read failures (path-free), or None for another failure
        for i, loc in enumerate(candidates):
            restored, problem, expected = self._try_restore(loc, target, partial, explicit)
            share = (start_checksums(restored.state, host_arrays=_sync.process_count() == 1)()
                     if restored is not None and expected is not None else None)
            copies = _whole_copies(restored.state) if share is not None else None
            verdicts = _sync.allgather("restore", json.dumps([problem and problem[:1000], share, copies]),
                                       timeout_ms=self._timeout_ms)
            verdicts = [json.loads(v) for v in verdicts]
            bad = [f"process {p}: {_brief(v)}" for p, (v, _, _) in enumerate(verdicts) if v]
            mismatch = next((v for v, _, _ in verdicts if v and v.startswith(_MISMATCH)), None)
            run_dir = next((v for v, _, _ in verdicts if v and v.startswith(_RUN_DIR)), None)
            if run_dir and explicit:  # a mistaken path, not damage: no "corrupt" error in the log
                raise UsageValueError(f"{loc.uri} {run_dir}. Pass one of them (Result.checkpoint is the run's latest).")
            if explicit and all(v == _GONE for v, _, _ in verdicts):  # a typo, not damage: no "corrupt" error
                raise FileNotFoundError(f"{loc.uri} does not exist: pass a checkpoint directory (checkpoint_<step>_<id>"
                                        ", or Result.checkpoint)")
            if explicit and any(v and v.startswith(_A_FILE) for v, _, _ in verdicts):
                raise UsageValueError(f"{loc.uri} {_A_FILE} (checkpoint_* beside it holds Ray's own bookkeeping files "
                                      "too): pass a checkpoint_<step>_<id> directory, or Result.checkpoint.")
            if mismatch:
                fix = ("Give a checkpoint of this model, or the model settings it was saved with." if explicit else
                       "Resume with the model and optimizer settings the checkpoint was saved with, or start a fresh "
                       "run under another name (RunConfig(name=...); on the command line, --set run.name=...).")
                raise CheckpointMismatchError(f"{loc.uri} {mismatch}. {fix}")
            if not bad and expected is not None:
                mismatch = self._checksum_mismatch(restored.state, expected, [s for _, s, _ in verdicts],
                                                   [c for _, _, c in verdicts])
                bad = [mismatch] if mismatch else []  # the same on every process: they all hold every share
            if not bad:
                if i:
                    logger.warning("Resumed from %s (step %d) after rejecting %d newer checkpoint(s): %s",
                                   loc.uri, restored.step, i, "; ".join(problems))
                logger.info("Restored step %d from %s.", restored.step, loc.uri)
                return restored
            reads = [v for v, _, _ in verdicts if v]
            read_only = bool(reads) and all(v.startswith(_READ) for v in reads)
            read_failures.append([v.replace(loc.uri, "<checkpoint>") for v in reads] if read_only else None)
            # Every file there, and the read itself failed: damaged bytes, storage, or the target (which the checks
            # before reading do not catch every way of): not called corrupt outright.
            message = f"{loc.uri} {'could not be read' if read_only else 'is corrupt or partial'} ({'; '.join(bad)})"
            problems.append(message)
            if not explicit and i + 1 < len(candidates):
                logger.warning("Checkpoint %s; falling back to the previous checkpoint %s.", message, candidates[i + 1].uri)
            else:
                logger.error("Checkpoint %s.", message)
        if len(read_failures) > 1 and read_failures[0] is not None and all(r == read_failures[0]
                                                                            for r in read_failures):
            # The same read failure on every checkpoint, old and new: the target they were all read into is the
            # likely cause (damage rarely repeats itself exactly). Not a RestoreTargetError: storage that is out of
            # reach fails alike, and FailureConfig's retry is the cure there.
            raise CheckpointCorruptError(
                f"Every checkpoint tried ({len(candidates)}) failed to read in the same way, which points at the "
                "restore target rather than at the files: check its leaves' shapes, dtypes and shardings. "
                f"{_TARGET_FIX}. If the storage was out of reach, the same run resumes once it reads again. "
                "What failed: " + " | ".join(problems))
        if explicit:
            raise CheckpointCorruptError(f"No usable checkpoint: {' | '.join(problems)}")
        # The advice first: the problems of every checkpoint tried, one per process each, filled a terminal's line
        # before it (a review: the CLI's one line ended inside TensorStore's object text).
        raise CheckpointCorruptError(
            f"No usable checkpoint: all {len(problems)} that this run keeps failed to restore, newest first "
            f"({', '.join(loc.uri.rsplit('/', 1)[-1] for loc in candidates)}). If the storage was out of reach, the "
            "same run resumes once it reads again; if the files are damaged, start a fresh run under another name "
            "(RunConfig(name=...); on the command line, --set run.name=...), optionally from earlier weights "
            "(final_model/, or a copy of a checkpoint), and keep more checkpoints to fall back to "
            "(CheckpointConfig(num_to_keep)). What failed: " + " | ".join(problems))

    def _try_restore(self, loc: _Location, target, partial: bool = False,
                     explicit: bool = True) -> Tuple[Optional[Restored], Optional[str], Optional[list]]:
        """Restore one checkpoint on this process: (result, None, checksums to verify, or None) or
        (None, what is wrong, None). Communicates with no other process, so a failure here cannot hang."""
        import jax
        import orbax.checkpoint as ocp

        try:
            if not _exists(loc):
                return None, _GONE, None
            if _is_file(loc):
                return None, _A_FILE, None
            for required in (*_finished_marks(loc), META_FILE, f"{STATE_ITEM}/_METADATA"):
                if not _exists(loc, required):
                    inside = _checkpoints_in(loc) if required == "_CHECKPOINT_METADATA" else []
                    if inside:  # a run directory, given for one of its checkpoints: not damage
                        return None, (f"{_RUN_DIR}{len(inside)}; the latest is "
                                      f"{loc.uri.rstrip('/')}/{inside[-1]}"), None
                    return None, f"{required} is missing (an unfinished or damaged save)", None
            meta = _read_json(loc, META_FILE)
            if meta.get("format") != FORMAT:
                return None, f"not a ray_jax_train checkpoint (format {meta.get('format')!r})", None
            handler = _composite_handler()
            import etils.epath as epath

            saved_tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(loc.uri) / STATE_ITEM).tree
            if target is None:  # the state as saved, on the host (np.empty commits no memory until written)
                target = jax.tree.map(lambda m: np.empty(m.shape, m.dtype) if hasattr(m, "dtype") else m,
                                      saved_tree)
            given, target, under_value = target, *_under_value(saved_tree, target)
            mismatch = _state_mismatch(saved_tree, target, partial,
                                       hint_partial=explicit)  # a resume's target is the whole state: no fix there
            if mismatch:
                return None, _MISMATCH + mismatch, None
            # The handler, not a Checkpointer: a Checkpointer ends restore with a barrier that a process whose
            # read failed would never reach; agreement happens afterwards through the key-value store instead.
            try:
                result = handler.restore(
                    epath.Path(loc.uri),
                    ocp.args.Composite(**{STATE_ITEM: ocp.args.PyTreeRestore(
                        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                        partial_restore=partial)}),
                )
            except Exception as exc:  # bad bytes, storage, or a target orbax cannot fill: told apart by the caller
                first_line = str(exc).splitlines()[0][:300] if str(exc) else ""
                return None, f"{_READ}{type(exc).__name__}: {first_line}", None
            state = result[STATE_ITEM]
            if under_value:  # back to the target's own shape: each array where the pure dict had it
                state = jax.tree_util.tree_map_with_path(
                    lambda path, _, got: got["value"] if _key_names(path) in under_value else got, given, state)
            recorded = meta.get("checksums")
            if recorded == CHECKSUMS_FILE:  # written after the orbax commit; absent if the save never finished
                if not _exists(loc, CHECKSUMS_FILE):
                    return None, f"{CHECKSUMS_FILE} is missing (an unfinished save)", None
                recorded = _read_json(loc, CHECKSUMS_FILE)
            expected = None
            if isinstance(recorded, dict):
                expected = _expected_for(recorded, target)
            elif isinstance(recorded, list) and not partial:
                expected = recorded  # older files: a bare list in the saved state's leaf order
            restored = Restored(state=state, step=int(meta["step"]), data_state=meta.get("data_state"),
                                path=loc.uri, metadata=meta)
            return restored, None, expected if self.verify else None
        except Exception as exc:  # any read/decoding failure means this checkpoint is unusable
            return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}", None

    @staticmethod
    def _checksum_mismatch(state, expected: list, shares: list, copies: Optional[list] = None) -> Optional[str]:
        """What differs between the recorded checksums and those of the restored `state`, or None. `copies`: each
        process's `_whole_copies` flags; a leaf every process holds whole is compared copy by copy."""
        import jax

        got = combine_checksums(shares)
        if copies and len(shares) > 1 and all(c is not None for c in copies):
            # A target on each process's own devices (params built per worker, as with torch) restores a whole
            # copy on each: each copy must match the record, where the shares of a global array add up.
            for i in range(len(got)):
                if got[i] is not None and all(c[i] for c in copies):
                    held = {tuple(share[i]) for share in shares}
                    got[i] = list(held.pop()) if len(held) == 1 else ["the processes' copies differ"]
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
        if len(got) != len(expected):
            return f"the state has {len(got)} arrays but the checkpoint recorded {len(expected)}"
        # Checkpoints from before the positional sum recorded two values: those two are compared.
        wrong = [paths[i] for i, (a, b) in enumerate(zip(got, expected))
                 if a is not None and b is not None and a[:len(b)] != b]
        if wrong:
            return f"checksum mismatch in {', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}"
        return None


# ------------------------------------------------------------------------------------------------------------
# Functional API for custom loops
# ------------------------------------------------------------------------------------------------------------

_default: Optional[JaxCheckpointer] = None


def _default_checkpointer() -> JaxCheckpointer:
    global _default
    if _default is None:
        _default = JaxCheckpointer(handle_preemption=False)
    return _default


def save_and_report(step: int, state, *, metrics=None, data_state=None, wait: bool = False,
                    validation: Any = False) -> str:
    """Save `state` (asynchronously, sharded) and report it with `metrics` through `ray.train.report`."""
    return _default_checkpointer().save(step, state, metrics=metrics, data_state=data_state, wait=wait,
                                        validation=validation)


def restore(target, checkpoint=None, *, fallback: bool = True, partial: bool = False) -> Optional[Restored]:
    """Restore into the abstract `target` from `checkpoint` or the run's latest good checkpoint (None if none).

    `partial=True` reads only the arrays `target` names, e.g. the params of a whole train state."""
    return _default_checkpointer().restore(target, checkpoint, fallback=fallback, partial=partial)


def wait_for_saves() -> None:
    """Block until the last `save_and_report` is on storage."""
    if _default is not None:
        _default.wait()
