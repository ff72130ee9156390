"""A streaming Hugging Face ``IterableDataset`` as a Ray datasource, one read task per shard.

Why not Ray's own Hugging Face datasource: its pickled dataset is unpickled by Ray as a task argument, so the
read worker imports ``datasets`` wherever Ray happens to deserialize, and a CI run once saw that import fail
with ``cannot import name 'HfFileSystem' from 'huggingface_hub'``: ``datasets``' import pulls names from
``huggingface_hub``'s lazy module, which fails on a half-made submodule left in ``sys.modules``. Ray cancels read
tasks a ``take()`` no longer needs by a KeyboardInterrupt in the worker's main thread and reuses the worker, so an
import it cut short can leave one (a second thread inside the same import does too). Here the dataset travels as
bytes and is unpickled inside the read task, after ``datasets`` was imported under a lock, retried once over a
clean slate if a half-made module stood in the way. Where the worker's modules are broken past that (a CI run
still saw the error once), the shard is read again in a fresh interpreter, whose imports nothing has cut.
"""
from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from typing import Iterator

from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from ray_jax_train._imports import uninterrupted_imports

logger = logging.getLogger(__name__)
_IMPORT_LOCK = threading.Lock()
_HALF_IMPORTED = ("datasets", "huggingface_hub")  # the packages whose half-made modules break the import


def _forget_half_imported() -> None:
    for name in [m for m in sys.modules if m.split(".", 1)[0] in _HALF_IMPORTED]:
        del sys.modules[name]


def import_datasets():
    """``import datasets``, robust to a concurrent or an earlier interrupted import in this process."""
    with _IMPORT_LOCK:
        for attempt in range(3):
            try:
                with uninterrupted_imports():  # a cancel cutting this import leaves no half-made fsspec or hub module
                    import datasets
                return datasets
            except ModuleNotFoundError as error:
                if error.name == "datasets" or attempt == 2:  # not installed here: nothing to wait for
                    raise
            except ImportError:
                if attempt == 2:
                    raise
            time.sleep(0.5)  # another thread may be finishing the same import
            if attempt == 1:
                _forget_half_imported()
    raise AssertionError("unreachable")


def _shard_batches(payload: bytes, num_shards: int, index: int, batch_size: int) -> Iterator:
    import pyarrow as pa

    import_datasets()
    dataset = pickle.loads(payload)
    if num_shards > 1:
        dataset = dataset.shard(num_shards=num_shards, index=index)
    for batch in dataset.with_format("arrow").iter(batch_size=batch_size):
        if isinstance(batch, dict):
            batch = pa.Table.from_pydict(batch)
        if not isinstance(batch, pa.Table):
            batch = pa.Table.from_pandas(batch, preserve_index=False)
        yield batch


def _shard_batches_in_fresh_interpreter(payload: bytes, num_shards: int, index: int, batch_size: int) -> Iterator:
    """The same batches, read by a child Python: its imports start clean whatever this worker's state."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # the worker's runtime_env paths
    with tempfile.TemporaryFile() as errors:  # a file, not a pipe: a chatty child cannot block on a full pipe
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(num_shards), str(index), str(batch_size)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, env=env)
        try:
            try:
                child.stdin.write(payload)  # the child reads all of it before it writes anything
                child.stdin.close()
            except BrokenPipeError:
                pass  # it died first: its exit status and stderr say why, below
            while True:
                try:
                    yield pickle.load(child.stdout)
                except EOFError:
                    break
        finally:
            child.stdout.close()
            if sys.exc_info()[0] is not None:
                child.kill()  # a cancel or a consumer done early: nothing waits for the rest
            if child.wait() != 0 and sys.exc_info()[0] is None:
                errors.seek(0)
                raise RuntimeError(f"reading shard {index} of a Hugging Face stream in a fresh interpreter failed "
                                   f"(exit {child.returncode}):\n{errors.read().decode(errors='replace')[-4000:]}")


def _read_shard(payload: bytes, num_shards: int, index: int, batch_size: int) -> Iterator:
    done = 0
    try:
        for batch in _shard_batches(payload, num_shards, index, batch_size):
            yield batch
            done += 1
        return
    except ImportError as error:
        logger.warning("Reading shard %d of a Hugging Face stream failed on an import in this reused Ray worker "
                       "(%s); reading it again in a fresh interpreter, after the %d batches already read.",
                       index, error, done)
    # A shard's batches come in the same order every read (a shuffled stream carries its seeded generator), so
    # the ones already yielded are skipped, not read twice.
    for number, batch in enumerate(_shard_batches_in_fresh_interpreter(payload, num_shards, index, batch_size)):
        if number >= done:
            yield batch


# The batches get the child's stdout to themselves: anything else printing (huggingface_hub prints its failed lazy
# imports) goes to stderr, before any import could print.
_CHILD = ("import os, sys; out = os.fdopen(os.dup(1), 'wb'); os.dup2(2, 1); sys.stdout = sys.stderr\n"
          "from ray_jax_train.text.hf_stream import _serve_shard; _serve_shard(out, sys.argv[1:])")


def _serve_shard(out, argv) -> None:
    """The child's side: the pickled dataset on stdin, one pickled Arrow table per batch on ``out``."""
    num_shards, index, batch_size = (int(arg) for arg in argv)
    payload = sys.stdin.buffer.read()
    for batch in _shard_batches(payload, num_shards, index, batch_size):
        pickle.dump(batch, out, protocol=5)
    out.flush()


class HFStreamDatasource(Datasource):
    """Streams a ``datasets.IterableDataset``: whole source shards (files) per read task."""

    def __init__(self, dataset, batch_size: int = 4096):
        from ray import cloudpickle

        self._payload = cloudpickle.dumps(dataset)  # bytes: Ray's argument unpickling imports nothing of HF
        self._shards = max(1, int(getattr(dataset, "num_shards", 1) or 1))
        self._batch_size = batch_size

    def estimate_inmemory_data_size(self):
        return None  # a stream: its size is unknown until read

    def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
        tasks = min(self._shards, max(1, parallelism))
        meta = BlockMetadata(num_rows=None, size_bytes=None, input_files=None, exec_stats=None)
        payload, batch_size = self._payload, self._batch_size
        return [ReadTask(lambda index=index: _read_shard(payload, tasks, index, batch_size), meta,
                         per_task_row_limit=per_task_row_limit) for index in range(tasks)]
