"""An offline corpus for the quick-start: the Python standard library's own source files.

Every Python installation ships it, so examples and tests can train a tokenizer and a small LM
with no network and no data files. Order is deterministic (sorted relative paths) so runs repeat.
"""
from __future__ import annotations

import ast
import os
import sysconfig
from typing import Iterator

# Third-party packages vary between machines (non-deterministic corpus); test suites hold files in
# odd encodings and deliberately broken syntax.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def _python_files(root: str) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    nodes = [tree] + [n for n in ast.walk(tree)
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return [d for d in (ast.get_docstring(n) for n in nodes) if d]


def local_corpus(*, kind: str = "source", max_docs: int | None = 1000, max_doc_chars: int = 20_000,
                 max_total_chars: int = 4_000_000, root: str | os.PathLike | None = None) -> Iterator[str]:
    """Yield text documents from the local standard library (or ``root``), capped in size.

    ``kind="source"`` yields whole ``.py`` files; ``kind="docstrings"`` yields each file's module,
    class and function docstrings joined by blank lines (closer to prose). Each document is cut
    to ``max_doc_chars``; iteration stops after ``max_docs`` documents or ``max_total_chars``.
    """
    if kind not in ("source", "docstrings"):
        raise ValueError(f"kind must be 'source' or 'docstrings', got {kind!r}")
    root = os.fspath(root) if root is not None else sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise FileNotFoundError(f"corpus root {root!r} is not a directory")
    count = total = 0
    for path in _python_files(root):
        if (max_docs is not None and count >= max_docs) or total >= max_total_chars:
            return
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        if kind == "docstrings":
            text = "\n\n".join(_docstrings(text))
        text = text.strip()[:max_doc_chars]
        if not text:
            continue
        text = text[:max_total_chars - total]
        count += 1
        total += len(text)
        yield text
