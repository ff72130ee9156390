"""Run outputs in Ray Train's storage, local path or URI alike, and a check that every node sees the same storage.

A multi-node run writes checkpoints, metrics and models from several nodes into one run directory. That only
works when the storage is a URI (gs://, s3://) or a path every node mounts; a node-local `./runs` silently
splits a checkpoint over disks and loses it with the node. Ray's own check for this is skipped by our
checkpoint upload, so `JaxCheckpointer` checks it: process 0 writes a token that every process must read back.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from contextlib import contextmanager
from typing import Iterator, Optional, Tuple

MARKER_NAME = ".ray_jax_train_storage_check"


class StoragePackageMissing(ImportError):
    """A package that orbax needs for the run's storage is not installed (a retry finds it missing too)."""

    retry_repeats_it = True


_CLIENTS = {"gs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3")}  # scheme: (fsspec's package for it, our extra)


def etils_reaches(scheme: str) -> bool:
    """Whether etils (orbax's metadata files, JAX's compilation cache) can reach `scheme`:// here: through fsspec's
    package for it, or for gs:// through TensorFlow's gfile where TensorFlow is installed (unless EPATH_USE_TF says
    no)."""
    import importlib.util

    if scheme == "gs" and importlib.util.find_spec("tensorflow") is not None and \
            os.environ.get("EPATH_USE_TF", "").lower() not in ("false", "no", "f", "0"):
        return True
    return importlib.util.find_spec(_CLIENTS[scheme][0]) is not None


def jax_can_cache_in(storage: str) -> bool:
    """Whether JAX can keep its compilation cache at this URI itself: gs:// (through etils), plain paths only (a
    '?' carries filesystem options JAX would not read)."""
    return storage.startswith("gs://") and "?" not in storage


def require_fsspec_client(scheme: str) -> None:
    """Orbax writes its checkpoints' metadata files through etils; without a client for the scheme the first save
    failed in orbax, a whole save interval into the run."""
    if not etils_reaches(scheme):
        package, extra = _CLIENTS[scheme]
        raise StoragePackageMissing(
            f"Checkpoints in {scheme}:// storage need the {package} package: orbax writes its metadata files through "
            f"fsspec's {package}. Install it where the workers run (every node): pip install "
            f"'ray-jax-train[{extra}]' (or pip install {package}).")


def is_uri(path: str) -> bool:
    return "://" in str(path)


def absolute(path: str) -> str:
    """An absolute local path; a URI unchanged (`os.path.abspath('gs://b/x')` would make a local 'gs:' folder)."""
    path = os.fspath(path)
    if is_uri(path):
        return path
    return os.path.abspath(os.path.expanduser(path))


def filesystem(path: str):
    """(pyarrow filesystem, path within it) for a local path or a URI."""
    import pyarrow.fs as pafs

    if is_uri(path):
        try:
            return pafs.FileSystem.from_uri(path)
        except ValueError as exc:  # pyarrow.ArrowInvalid: "Cannot parse URI", naming neither the cause nor the fix
            if "parse URI" not in str(exc):
                raise
            raise ValueError(f"{path!r} is not a valid URI: a space, a non-ASCII letter or another reserved character "
                             "must be percent-encoded in it (a space as %20); or give a local path") from None
    return pafs.LocalFileSystem(), absolute(path)


def join(base: str, *parts: str) -> str:
    """`os.path.join` that keeps a URI's scheme and slashes, and its query (an S3 endpoint_override) at the end."""
    if is_uri(base):
        head, sep, query = base.partition("?")
        return "/".join([head.rstrip("/")] + [p.strip("/") for p in parts]) + sep + query
    return os.path.join(base, *parts)


def parent(path: str) -> str:
    """The directory holding `path`, a local path (made absolute) or a URI (its query, an S3 endpoint_override, kept
    at the end)."""
    if is_uri(path):
        where, sep, query = path.partition("?")
        return where.rstrip("/").rsplit("/", 1)[0] + sep + query
    return os.path.dirname(absolute(path).rstrip(os.sep))


def qualified(fs_path: str, storage: str) -> str:
    """A path Ray reports within a URI storage's filesystem (`bucket/runs/...`, as `Checkpoint.path` is) as a URI
    of that storage again: scheme in front, query (the endpoint) behind. Local paths pass unchanged."""
    if not is_uri(storage) or is_uri(fs_path):
        return fs_path
    scheme, rest = storage.split("://", 1)
    query = rest.partition("?")[2]
    return f"{scheme}://{fs_path.lstrip('/')}" + (f"?{query}" if query else "")


def in_ray_package_cache(path: str) -> bool:
    """Whether a local path lies in a Ray job's unpacked working directory (where a relative run.storage_path
    lands under `ray job submit --working-dir`): Ray deletes it with its cache, and a changed working directory
    unpacks elsewhere, so a resubmitted job would start over instead of resuming."""
    parts = absolute(path).split(os.sep) if not is_uri(path) else []
    return "runtime_resources" in parts and any(p.startswith("working_dir_files") for p in parts)


def exists(path: str) -> bool:
    """Whether a file or directory is there, local path or URI. Storage that cannot be reached raises: taken
    for absence, a resumed run would train a new tokenizer over the one its checkpoint needs."""
    import pyarrow.fs as pafs

    fs, fs_path = filesystem(path)
    return fs.get_file_info(fs_path).type != pafs.FileType.NotFound


def read_text(path: str) -> str:
    """A text file's contents, local path or URI; FileNotFoundError when it is not there."""
    import pyarrow.fs as pafs

    fs, fs_path = filesystem(path)
    if fs.get_file_info(fs_path).type != pafs.FileType.File:
        raise FileNotFoundError(path)
    with fs.open_input_stream(fs_path) as f:
        return f.read().decode()


@contextmanager
def local_dir_for(destination: str, fs=None) -> Iterator[str]:
    """A local directory to write into; on exit its files are copied to `destination` when that is remote.

    `fs` is the destination's pyarrow filesystem when `destination` is a path within it (as Ray's storage
    context gives them); otherwise `destination` is a local path or a URI.
    """
    import pyarrow.fs as pafs

    if fs is None:
        fs, destination = filesystem(destination)
    if isinstance(fs, pafs.LocalFileSystem):
        os.makedirs(destination, exist_ok=True)
        yield destination
        return
    staging = tempfile.mkdtemp(prefix="rjt_upload_")
    try:
        yield staging
        fs.create_dir(destination, recursive=True)
        pafs.copy_files(staging, destination, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class AppendOnlyFile:
    """A text file in run storage that grows by lines: appended locally, rewritten whole on object stores.

    Object stores have no append; metrics files are small, so rewriting the file is cheap enough at most every
    `flush_every_s` (and on `close`), and lines an earlier (restarted) attempt wrote are kept.
    """

    def __init__(self, fs, path: str, flush_every_s: float = 30.0):
        import pyarrow.fs as pafs

        self._fs, self._path = fs, path
        self._local = isinstance(fs, pafs.LocalFileSystem)
        self._lines = b""
        self._flush_every_s, self._flushed_at, self._dirty = flush_every_s, float("-inf"), False
        parent = path.rsplit("/", 1)[0]
        # A line a killed attempt cut short is ended first: the next attempt's first line ran on into it, and the
        # record that marks the resume was lost with both (a Tune chaos review).
        self._cut_short = False
        if self._local:
            os.makedirs(parent, exist_ok=True)
            try:
                with open(path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    self._cut_short = f.read(1) != b"\n"
            except OSError:  # none yet, or empty
                pass
            return
        fs.create_dir(parent, recursive=True)
        if fs.get_file_info(path).type == pafs.FileType.File:
            with fs.open_input_stream(path) as f:
                self._lines = f.read()
            if self._lines and not self._lines.endswith(b"\n"):
                self._lines += b"\n"

    def append(self, line: str) -> None:
        data = (line.rstrip("\n") + "\n").encode()
        if self._cut_short:
            data, self._cut_short = b"\n" + data, False
        if self._local:
            with open(self._path, "ab") as f:
                f.write(data)
            return
        self._lines += data
        self._dirty = True
        if time.monotonic() - self._flushed_at >= self._flush_every_s:
            self.close()

    def close(self) -> None:
        """Write what is pending (object stores only; local lines are on disk already)."""
        if self._local or not self._dirty:
            return
        with self._fs.open_output_stream(self._path) as f:
            f.write(self._lines)
        self._flushed_at, self._dirty = time.monotonic(), False


def write_marker(run_dir: str) -> Tuple[str, str]:
    """Process 0's side: a fresh token in the run directory. Returns (marker path, token)."""
    os.makedirs(run_dir, exist_ok=True)
    token = uuid.uuid4().hex
    path = os.path.join(run_dir, MARKER_NAME)
    with open(path, "w") as f:
        f.write(token)
    return path, token


def marker_problem(path: str, token: str) -> Optional[str]:
    """Every process's side: why this node does not see process 0's run directory, or None when it does."""
    try:
        with open(path) as f:
            seen = f.read().strip()
    except OSError:
        seen = None
    if seen == token:
        return None
    import socket

    what = "is missing" if seen is None else "holds another run's token"
    return (f"run storage {os.path.dirname(path)} is not shared with this node ({socket.gethostname()}): the "
            f"check file that process 0 wrote there {what} here. On a multi-node cluster, Ray Train's storage_path must be a "
            "directory every node mounts (NFS, a cluster filesystem) or a URI such as gs://bucket/runs or "
            "s3://bucket/runs; otherwise checkpoints are split over node-local disks and lost with a node "
            "(see docs/cluster.md).")
