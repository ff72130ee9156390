"""Run a function once a module is imported, without importing it first.

The orbax guard wraps orbax's save in every multi-process worker; importing orbax for it took ~0.9 s of every
worker's start-up, also in loops that never save with orbax.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from typing import Callable

_lock = threading.Lock()


class _Loader(importlib.abc.Loader):
    """The module's own loader, then `then()`."""

    def __init__(self, loader, then: Callable[[], None]):
        self._loader, self._then = loader, then

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self._loader  # the module sees its own loader (resources, reloads)
        module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._then()

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, then: Callable[[], None]):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        with _lock:
            if self not in sys.meta_path:
                return None
            sys.meta_path.remove(self)  # once; and the search below must not find this finder again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader, self.then)
        return spec


def call_after_import(name: str, then: Callable[[], None]) -> None:
    """`then()` now if `name` is imported already, else right after it is (once)."""
    if name in sys.modules:
        then()
        return
    with _lock:
        if any(isinstance(f, _Finder) and f.name == name and f.then == then for f in sys.meta_path):
            return
        sys.meta_path.insert(0, _Finder(name, then))
