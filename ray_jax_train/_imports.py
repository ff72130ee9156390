"""Imports that Ray's cancel (a KeyboardInterrupt) would cut short finish first; a failed one can be redone.

Ray cancels a task that a ``take()`` no longer needs by a KeyboardInterrupt in the worker's main thread, and
then reuses the worker. Cut inside an import, Python drops the modules whose code was still running but keeps
their finished submodules. The next import of the package runs its ``__init__`` again, finds the submodule
already in ``sys.modules``, never binds it as the package's attribute, and fails: a CI run saw "partially
initialized module 'fsspec' has no attribute 'utils'" in every later task on that worker, Ray's own file
listing included, after an import of this package (which imports ``ray.train``, hence fsspec) was cut.

So the interrupt waits until the imports in the block are done: Ray's cancel calls the main thread's SIGINT
handler, which records it, and it is raised when the block ends. An import that fails anyway is redone with
its finished submodules bound to the package before its code runs, as they would have been had it not been
cut (dropping them as well would run them again, and some cannot: ``datasets`` registers pyarrow extension
types, which pyarrow refuses twice).
A cut outside any such block (Ray Data's own lazy ``fsspec`` import in a read task, in a worker that never
imports this package) is met by ``guard_cut_imports``: Ray runs it first in every worker of a Ray this package
starts (``worker_setup_hook``), and the package runs it when a Ray worker imports it. Its SIGINT handler marks the
imports the interrupt is cutting, so that their next import binds their finished submodules.
Stdlib only (with _after_import, stdlib too): it runs before anything else of the package.
"""
from __future__ import annotations

import _frozen_importlib
import contextlib
import importlib.abc
import signal
import sys
import threading
from typing import Iterable, Optional, Set

from ray_jax_train._after_import import WrappedLoader

_lock = threading.RLock()  # reentrant: the SIGINT handler below may run while the main thread holds it


class _BindingLoader(WrappedLoader):
    """The package's own loader, after binding the submodules already in ``sys.modules`` to the new module."""

    def __init__(self, loader, finder: "_RemakeFinder"):
        super().__init__(loader)
        self._finder = finder

    def exec_module(self, module):
        prefix = module.__name__ + "."
        for name, child in list(sys.modules.items()):
            if name.startswith(prefix) and "." not in name[len(prefix):]:
                setattr(module, name[len(prefix):], child)
        super().exec_module(module)  # cut again: the finder stays for the next try
        self._finder.made(module.__name__)


class _RemakeFinder(importlib.abc.MetaPathFinder):
    """Gives the packages a cut import dropped a loader that binds their finished submodules first."""

    def __init__(self):
        self.packages: Set[str] = set()

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.packages:
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _BindingLoader(spec.loader, self)
                return spec
        return None

    def made(self, package: str) -> None:
        with _lock:
            self.packages.discard(package)
            if not self.packages:  # a new list: another thread's import may be iterating over the old one
                sys.meta_path = [f for f in sys.meta_path if f is not self]


_finder = _RemakeFinder()


def _dropped_parents(names: Iterable[str], dropping: Optional[str]) -> Set[str]:
    present = set(sys.modules) - {dropping}
    missing = set()
    for name in names:
        if name not in present:
            continue
        parts = name.split(".")
        missing.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p not in present)
    return missing


def remake_with_finished_submodules(packages: Iterable[str]) -> None:
    """The next import of each package binds its submodules that are in ``sys.modules`` before its code runs."""
    packages = set(packages)
    if not packages:
        return
    with _lock:
        _finder.packages |= packages
        if _finder not in sys.meta_path:
            sys.meta_path = [_finder, *sys.meta_path]


def mend_cut_imports() -> None:
    """An import cut earlier outside a guarded block (Ray Data's own fsspec import, say) left finished submodules
    without their package: the next import of that package binds them first, as after a cut inside one."""
    remake_with_finished_submodules(_dropped_parents(list(sys.modules), None))


@contextlib.contextmanager
def _interrupts_held():
    """A SIGINT (Ray's cancel, a Ctrl-C) arriving in the block is acted on when the block ends, not inside it."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread receives signals, and only it may set their handlers
        return
    held = []
    previous = signal.getsignal(signal.SIGINT)
    if previous is None:  # a handler set outside Python: it could not be put back
        yield
        return
    try:
        signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    except (ValueError, OSError):  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held and callable(previous):
            previous(signal.SIGINT, held[0])  # Python's default raises KeyboardInterrupt here, after the imports
        elif held and previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)  # the default action, as the signal would have had


@contextlib.contextmanager
def uninterrupted_imports(package_being_made: Optional[str] = None):
    """Imports in the block finish before an interrupt is raised, and one that fails anyway (an error, a signal
    another thread takes) leaves its packages importable again.

    ``package_being_made``: the package whose ``__init__`` holds the block; Python drops it after a failure.
    """
    mend_cut_imports()
    before = set(sys.modules)
    try:
        with _interrupts_held():
            yield
    except BaseException:
        made = [name for name in list(sys.modules) if name not in before]
        remake_with_finished_submodules(_dropped_parents(made, package_being_made))
        raise


def worker_setup_hook():
    """The worker_process_setup_hook of every Ray this package starts (and of the test suite's).

    A function Ray pickles by value (it is made here, not importable by name), that guards a worker only where
    this package is importable: a hook Ray loads by module path kills every worker that cannot import it (a task
    under a runtime_env of another Python), and Ray starts another, which dies too, for ever.
    """
    def guard_cut_imports_where_installed():
        try:
            from ray_jax_train._imports import guard_cut_imports as guard
        except ImportError:
            return
        guard()

    return guard_cut_imports_where_installed


_FIND_AND_LOAD = _frozen_importlib._find_and_load.__code__


def guard_cut_imports() -> None:
    """From now on a SIGINT (Ray's cancel) that cuts an import in this process, anyone's, leaves it importable again.

    A CI worker's Ray Data read task failed "partially initialized module 'fsspec' has no attribute 'utils'" after
    an earlier task's first import of fsspec there was cancelled, with no import of this package in between to
    mend it. Only Python's default handler is wrapped: a handler of the user's own is theirs to keep.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _interrupt_marking_cut_imports)
    except (ValueError, OSError):  # not the main interpreter
        pass


def _interrupt_marking_cut_imports(signum, frame):
    """Python's KeyboardInterrupt, after marking the imports it cuts (each ``_find_and_load`` on the stack)."""
    cut, at = [], frame
    while at is not None:
        if at.f_code is _FIND_AND_LOAD:
            name = at.f_locals.get("name")
            if isinstance(name, str):
                cut.append(name)
        at = at.f_back
    remake_with_finished_submodules(cut)
    signal.default_int_handler(signum, frame)


def in_ray_worker() -> bool:
    """Whether this process is a Ray worker (a task's or an actor's), without importing Ray."""
    worker = sys.modules.get("ray._private.worker")
    return worker is not None and getattr(getattr(worker, "global_worker", None), "mode", None) == getattr(
        worker, "WORKER_MODE", 1)
