"""A persistent compilation-cache entry that a killed process left half-written is dropped, so it is written whole.

JAX writes an entry in place and never replaces one that exists: a worker killed while writing left a truncated
file that every later start failed to read (JAX warns and compiles the program) and never wrote again, so every
restart compiled those programs again (a failure-injection review: all 29 entries torn, recompiled on each
restart). An entry JAX cannot read is now removed by process 0, the process that writes entries, and the compile
that follows writes it whole.
"""
from __future__ import annotations

import functools
import logging

logger = logging.getLogger(__name__)


def drop_unreadable_entries() -> bool:
    """Make JAX's cache read remove an entry it cannot read. True if in place (idempotent)."""
    try:
        from jax._src import compilation_cache
    except ImportError:  # pragma: no cover - another JAX layout: its own behaviour stands
        return False
    read = getattr(compilation_cache, "get_executable_and_time", None)
    if read is None:
        return False
    if getattr(read, "_drops_unreadable", False):
        return True

    @functools.wraps(read)
    def read_or_drop(cache_key, *args, **kwargs):
        try:
            return read(cache_key, *args, **kwargs)
        except Exception:
            _drop(cache_key)
            raise  # JAX warns and compiles, as before

    read_or_drop._drops_unreadable = True
    compilation_cache.get_executable_and_time = read_or_drop
    return True


def _drop(key: str) -> None:
    try:
        import jax
        from jax._src import compilation_cache

        path = getattr(compilation_cache._cache, "_path", None)
        if path is None or jax.process_index() != 0:
            return
        for suffix in ("-cache", "-atime"):  # jax._src.lru_cache's entry and its access time
            (path / f"{key}{suffix}").unlink(missing_ok=True)
        logger.warning("Removed the unreadable compilation-cache entry %s (a write cut short); the program is "
                       "compiled and written again.", key)
    except Exception as exc:  # noqa: BLE001 - only a speed-up is lost
        logger.debug("Could not remove the unreadable cache entry %s: %s", key, exc)
