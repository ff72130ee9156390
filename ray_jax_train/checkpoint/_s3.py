"""Orbax checkpoints in s3:// storage: AWS, or an S3-compatible endpoint (MinIO, R2, Ceph) named by Ray's
`storage_path="s3://bucket/runs?endpoint_override=http://host:9000&region=..."`.

Orbax reaches s3:// through two clients that never see Ray's pyarrow filesystem and its endpoint: its small
files go through fsspec (s3fs), its arrays through tensorstore, for which orbax builds file and GCS specs only
(an s3:// path fails there as "not absolute"). `use` gives both the endpoint and region of Ray's filesystem,
in this process. Credentials are not passed on: pyarrow, s3fs and tensorstore each read the standard AWS ones
(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, ~/.aws, an instance role), which every Ray worker must have.
"""
from __future__ import annotations

import functools
import os
import threading
from typing import Any, Dict, Optional, Tuple

from ray_jax_train.storage import require_fsspec_client

_lock = threading.Lock()
_endpoint: Optional[str] = None  # this process's S3 endpoint ("" for AWS's own), once one was used
_buckets: Dict[str, Tuple[Any, Dict[str, str]]] = {}  # bucket -> (pyarrow filesystem, tensorstore s3 options)


def is_s3(filesystem) -> bool:
    return getattr(filesystem, "type_name", "") == "s3"


def _endpoint_and_region(filesystem) -> Tuple[str, str]:
    # Pickling is the one public view of an S3FileSystem's options (it is how Ray ships it to workers);
    # pyarrow puts an AWS_ENDPOINT_URL from the environment there too.
    options = filesystem.__reduce__()[1][0]
    endpoint = options.get("endpoint_override") or ""
    if endpoint and "://" not in endpoint:
        endpoint = f"{options.get('scheme') or 'https'}://{endpoint}"
    return endpoint.rstrip("/"), options.get("region") or ""


def use(filesystem, fs_path: str) -> None:
    """Let orbax in this process reach the bucket of `fs_path` where pyarrow's `filesystem` does."""
    global _endpoint
    bucket = fs_path.lstrip("/").split("/", 1)[0]
    endpoint, region = _endpoint_and_region(filesystem)
    with _lock:
        if bucket in _buckets and _endpoint == endpoint:
            return
        if _endpoint is not None and _endpoint != endpoint:
            # s3fs takes one endpoint per process, and orbax's paths carry none.
            raise ValueError(
                f"Checkpoint storage s3://{bucket} is at the S3 endpoint {endpoint or 'of AWS'}, but this process "
                f"already reads or writes checkpoints at {_endpoint or 'the endpoint of AWS'}; orbax can use only "
                "one S3 endpoint per process. Keep the run's storage_path and the checkpoints it restores on one "
                "endpoint (copy the checkpoint over first).")
        require_fsspec_client("s3")
        _install_spec_hook()
        if endpoint:
            import fsspec

            conf = fsspec.config.conf.setdefault("s3", {})
            conf["endpoint_url"] = endpoint
            conf["client_kwargs"] = {**conf.get("client_kwargs", {}), **({"region_name": region} if region else {})}
        options = {"endpoint": endpoint} if endpoint else {}
        if region:  # given, tensorstore skips asking AWS for the bucket's region (which a custom endpoint cannot answer)
            options["aws_region"] = region
        _endpoint = endpoint
        _buckets[bucket] = (filesystem, options)


def known_filesystem(uri: str):
    """(pyarrow filesystem, path) for an s3:// URI whose bucket this process uses already, else None.

    A bare `s3://bucket/...` (as processes exchange checkpoint paths) would otherwise open at AWS's endpoint.
    """
    if not uri.startswith("s3://") or "?" in uri:
        return None
    path = uri[len("s3://"):]
    known = _buckets.get(path.split("/", 1)[0])
    return None if known is None else (known[0], path)


def _to_s3(spec):
    """Orbax's tensorstore spec for a gs:// path, as the same spec for the s3 bucket of that name."""
    if isinstance(spec, dict):
        if spec.get("driver") in ("gcs", "gcs_grpc"):
            return {**spec, "driver": "s3", **_buckets.get(spec.get("bucket"), (None, {}))[1]}
        return {key: _to_s3(value) for key, value in spec.items()}
    if isinstance(spec, list):
        return [_to_s3(value) for value in spec]
    if isinstance(spec, str) and spec.startswith("gs://"):
        bucket, _, path = spec[len("gs://"):].partition("/")
        return {"driver": "s3", "bucket": bucket, "path": path, **_buckets.get(bucket, (None, {}))[1]}
    return spec


def _install_spec_hook() -> None:
    from orbax.checkpoint._src.serialization import tensorstore_utils

    original = getattr(tensorstore_utils, "build_kvstore_tspec", None)
    if original is None:
        raise RuntimeError("This orbax-checkpoint has no tensorstore_utils.build_kvstore_tspec, through which "
                           "ray_jax_train gives orbax its s3:// specs; use orbax-checkpoint>=0.11,<0.13.")
    if getattr(original, "_ray_jax_train_s3", False):
        return

    @functools.wraps(original)
    def build_kvstore_tspec(directory, *args, **kwargs):
        path = os.fspath(directory)
        if not path.startswith("s3://"):
            return original(directory, *args, **kwargs)
        # Orbax builds the right layout (OCDBT, per-process parts) for gs:// only; the same with S3's driver.
        return _to_s3(original("gs://" + path[len("s3://"):], *args, **kwargs))

    build_kvstore_tspec._ray_jax_train_s3 = True
    tensorstore_utils.build_kvstore_tspec = build_kvstore_tspec
