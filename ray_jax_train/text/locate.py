"""Find the file and line of the row a failed read or tokenisation stumbled on.

Ray Data reports a broken JSON line as "Unexpected character ... at position 39468" and a number where text belongs
as "column 'text' holds a int": neither says in which of the files, nor where. Reading the local files again on the
driver, once the run has already failed, does say so. Only local files are read (a URI's data may be large and far
away), within a time budget: a search that finds nothing leaves the error as it was.
"""
from __future__ import annotations

import ast
import io
import json
import re
import time
from typing import Any, Iterable, Iterator, Optional, Sequence

# Words of the errors worth a search: reading or decoding a file, or a row whose value is not what it should be.
# Whole words where a part would match elsewhere ("role" in "controller").
_DATA_ERROR = re.compile(r"decod|json|\bpars(e|ing)\b|arrowinvalid|unmatched|utf-8|not text|\bholds an? |\brole\b"
                         r"|conversation", re.IGNORECASE)


# check_roles' words (encode.py): the role is a Python repr there.
_UNKNOWN_ROLE = re.compile(r"has role ('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"), which the chat template does not know")

BAD_ROW_FOUND = "The first row that cannot be read as a document"


def looks_like_a_bad_row(message: str) -> bool:
    """Whether an error's text points at the data's rows (not a missing file, a tokenizer or a cluster)."""
    return bool(_DATA_ERROR.search(message))


def find_bad_row(paths: Sequence[str], *, text_column: str = "text", messages_column: str = "messages",
                 unknown_role: Optional[str] = None, budget_s: float = 30.0) -> Optional[str]:
    """'<file>, line N: <what is wrong>' for the first row of the local files under `paths` that cannot be read as
    training text, or None (nothing found, URIs, or the budget ran out). JSON lines and text are read line by line
    (compressed ones too); a .json array whole; Parquet by its schema only; CSV not at all. `unknown_role`: a role
    the chat template was found not to know (only the tokenizer can tell), a bad row's mark too."""
    from .sources import _format_of, local_files

    files = local_files(paths)
    if files is None:
        return None
    deadline = time.monotonic() + budget_s
    for file in files:
        if time.monotonic() > deadline:
            return None
        try:
            found = _check_file(file, _format_of(file), text_column, messages_column, unknown_role, deadline)
        except OSError:
            continue  # unreadable now: the read's own error says so
        if found:
            return f"{file}, {found}"
    return None


def _check_file(file: str, format: Optional[str], text_column: str, messages_column: str,
                unknown_role: Optional[str], deadline: float) -> Optional[str]:
    if format == "parquet":
        return _check_parquet_schema(file, text_column, messages_column)
    if format == "text":
        for number, raw in _lines(file, deadline):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return f"line {number}: not UTF-8 text ({exc.reason} at byte {exc.start} of the line)"
        return None
    if format != "json":
        return None
    if ".jsonl" not in file.split("?", 1)[0].lower().rsplit("/", 1)[-1]:
        whole = _check_json_array(file, text_column, messages_column, unknown_role)
        if whole is not False:
            return whole
    for number, raw in _lines(file, deadline):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.rstrip(b"\r\n").decode("utf-8"))  # a line cut short: "Unterminated string"
        except UnicodeDecodeError as exc:
            return f"line {number}: not UTF-8 text ({exc.reason} at byte {exc.start} of the line)"
        except ValueError as exc:
            return f"line {number}: not a JSON object ({getattr(exc, 'msg', exc)}: column {getattr(exc, 'colno', '?')})"
        problem = row_problem(row, text_column, messages_column, unknown_role)
        if problem:
            return f"line {number}: {problem}"
    return None


def _lines(file: str, deadline: float) -> Iterator[tuple[int, bytes]]:
    import pyarrow as pa

    with pa.input_stream(file, compression="detect") as stream:  # .jsonl.gz and the like too
        for number, raw in enumerate(io.BufferedReader(stream), start=1):
            if number % 4096 == 0 and time.monotonic() > deadline:
                return
            yield number, raw


def _check_json_array(file: str, text_column: str, messages_column: str, unknown_role: Optional[str]):
    """The problem of a .json that holds one array, None if it is fine, False if it is not an array (then read as
    JSON lines)."""
    import pyarrow as pa

    with pa.input_stream(file, compression="detect") as stream:
        text = stream.read().decode("utf-8", errors="replace")
    if not text.lstrip().startswith("["):
        return False
    try:
        rows = json.loads(text)
    except ValueError as exc:
        return f"line {getattr(exc, 'lineno', '?')}: not valid JSON ({getattr(exc, 'msg', exc)})"
    for index, row in enumerate(rows):
        problem = row_problem(row, text_column, messages_column, unknown_role)
        if problem:
            return f"item {index} of its array: {problem}"
    return None


def row_problem(row: Any, text_column: str, messages_column: str, unknown_role: Optional[str] = None) -> Optional[str]:
    """What keeps one parsed row from being a document, in the pipeline's terms: a messages value wins when it holds
    turns, else the text value is read (null counts as empty)."""
    if not isinstance(row, dict):
        return f"{_a(row)} JSON {type(row).__name__}, not an object such as {{{text_column!r}: ...}}"
    messages = row.get(messages_column)
    if messages not in (None, []):
        if not isinstance(messages, list):
            return f"{messages_column!r} holds {_a(messages)} {type(messages).__name__}, not a list of messages"
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                return f"message {i} of {messages_column!r} has no string 'role' ({json.dumps(message)[:80]})"
            if message["role"] == unknown_role:
                return (f"message {i} of {messages_column!r} has role {unknown_role!r}, which the chat template "
                        "does not know")
            content = message.get("content")
            if content is not None and not isinstance(content, (str, list)):
                kind = type(content).__name__
                return f"message {i} of {messages_column!r} has {_a(content)} {kind} content, not text"
        return None
    text = row.get(text_column)
    if text is not None and not isinstance(text, str):
        return f"{text_column!r} holds {_a(text)} {type(text).__name__} ({json.dumps(text)[:60]}), not text"
    return None


def _check_parquet_schema(file: str, text_column: str, messages_column: str) -> Optional[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.ParquetFile(file).schema_arrow
    except (pa.ArrowException, ValueError) as exc:
        return f"not a Parquet file ({exc})"
    names = schema.names
    if messages_column in names or text_column not in names:
        return None
    kind = schema.field(text_column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)):
        return f"column {text_column!r} is of type {kind}, not string"
    return None


def where_the_bad_row_is(exc_text: str, paths: Iterable[str] | None, *, text_column: str = "text",
                         messages_column: str = "messages") -> str:
    """A sentence naming the first bad row for an error that looks like one, else "" (the error is left as it is)."""
    paths = list(paths or [])
    if not paths or not looks_like_a_bad_row(exc_text):
        return ""
    role = _UNKNOWN_ROLE.search(exc_text)
    found = find_bad_row(paths, text_column=text_column, messages_column=messages_column,
                         unknown_role=role and ast.literal_eval(role.group(1)))
    if not found:
        return ""
    return f"{'' if exc_text.rstrip().endswith('.') else '.'} {BAD_ROW_FOUND}: {found}."


def _a(value: Any) -> str:
    return "an" if type(value).__name__[0] in "aeiou" else "a"
