"""Run a function once a module is imported, without importing it first.

The orbax guard wraps orbax's save in every multi-process worker; importing orbax for it took ~0.9 s of every
worker's start-up, also in loops that never save with orbax.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
import threading
from typing import Callable

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_searching = threading.local()  # this thread is inside a finder's own spec search: finders step aside


def _without(finder) -> None:
    # A new list, not an edit in place: another thread's import may be iterating over the old one.
    with _lock:
        sys.meta_path = [f for f in sys.meta_path if f is not finder]


class WrappedLoader(importlib.abc.Loader):
    """A module's own loader, for a subclass to run code around ``exec_module``; the module sees its own loader."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self._loader  # resources and reloads go through the module's own loader
        module.__spec__.loader = self._loader
        self._loader.exec_module(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Loader(WrappedLoader):
    """The module's own loader, then `then()`."""

    def __init__(self, loader, finder: "_Finder"):
        super().__init__(loader)
        self._finder = finder

    def exec_module(self, module):
        super().exec_module(module)  # a failed import leaves the finder for the next try
        _without(self._finder)
        try:
            self._finder.then()
        except Exception:  # noqa: BLE001 - the user's import succeeded; what runs after it must not fail it
            logger.warning("After importing %s: %s failed", self._finder.name, self._finder.then, exc_info=True)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, then: Callable[[], None]):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or getattr(_searching, "active", False):
            return None
        _searching.active = True
        try:  # the spec the other finders give; a lookup without an import (find_spec) leaves this finder in place
            spec = importlib.util.find_spec(fullname)
        finally:
            _searching.active = False
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader, self)
        return spec


def call_after_import(name: str, then: Callable[[], None]) -> None:
    """`then()` now if `name` is imported already, else right after it is (once)."""
    if name in sys.modules:
        then()
        return
    with _lock:
        if any(isinstance(f, _Finder) and f.name == name and f.then == then for f in sys.meta_path):
            return
        sys.meta_path = [_Finder(name, then), *sys.meta_path]
