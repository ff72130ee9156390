"""Turn any supported text source into a ``ray.data.Dataset`` and find its text/messages column."""
from __future__ import annotations

import os
from typing import Any, Sequence

from .. import storage
from .errors import EmptyDatasetError, MissingColumnError, TextDataError
from .locate import BAD_ROW_FOUND

# File suffix -> reader; compressed variants (.jsonl.gz, ...) map like their inner suffix.
_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}


def _format_of(path: str) -> str | None:
    name = path.split("?", 1)[0].lower()  # a URI's query (s3://b/x.jsonl?endpoint_override=...) is no suffix
    for suffix in (".gz", ".zst", ".br", ".lz4"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return _FORMATS.get(os.path.splitext(name)[1])


def _hidden(name: str) -> bool:
    return name.startswith((".", "_"))  # metadata that Spark and Ray write beside the data


def _files_under(path: str) -> list[tuple[str, int]]:
    """(file, size) for a file, or for every file below a directory (hidden and metadata files skipped), on a
    local path or a URI (gs://, s3://, file://...)."""
    import pyarrow.fs as pafs

    if not storage.is_uri(path):
        path = os.path.expanduser(path)
        if not os.path.exists(path):
            shown = repr(path) if len(path) <= 120 else repr(path[:100]) + f" ... ({len(path)} characters)"
            raise FileNotFoundError(f"text source {shown} does not exist (strings are read as file paths; "
                                    f"in-memory texts: pass a list of dicts such as [{{'text': ...}}])")
        if not os.path.isdir(path):
            return [(path, os.path.getsize(path))]
        # os.walk, not a recursive listing: it does not follow directory links, so `latest -> v2` beside `v2/`
        # does not read v2 twice.
        return sorted((f, os.path.getsize(f)) for d, _, names in os.walk(path) for f in
                      (os.path.join(d, n) for n in names if not _hidden(n)))
    fs, fs_path = storage.filesystem(path)
    info = fs.get_file_info(fs_path)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"text source {path!r} does not exist")
    if info.type != pafs.FileType.Directory:
        return [(path, info.size or 0)]
    found = fs.get_file_info(pafs.FileSelector(fs_path, recursive=True))
    # Listed paths lack the scheme, host and query (gs://b/dir?x -> b/dir/...): splice them back into the URI.
    base, _, query = path.partition("?")
    base = base.rstrip("/")
    root = fs_path.rstrip("/")
    return sorted((base + f.path[len(root):] + (f"?{query}" if query else ""), f.size or 0) for f in found
                  if f.type == pafs.FileType.File and f.path.startswith(root) and not _hidden(f.base_name))


def plan_reads(paths: Sequence[str], format: str | None = None) -> list[tuple[str, list[tuple[str, int]]]]:
    """[(format, [(file, size)])] for the files under `paths`, in order, one entry per run of one format; raises
    what is wrong with them before any read (the driver checks a config's local paths so, before Ray starts)."""
    listed = [(p, _files_under(p)) for p in paths]
    found = [f for _, under in listed for f in under]
    if not found:
        raise EmptyDatasetError(f"no files found under {list(paths)}")
    if all(size == 0 for _, size in found):
        raise EmptyDatasetError(f"every file in {list(paths)} is empty")
    if format is not None:
        return [(format, found)]
    # Each path is of one format, so a stray notes.txt beside the .jsonl files of a directory is refused rather
    # than trained on; paths of different formats (a .jsonl file and a Parquet directory) are read each with its
    # own reader and joined (in order, Ray's union takes their blocks in turn: the same order every run).
    groups: list[tuple[str, list[tuple[str, int]]]] = []
    for path, under in listed:
        formats = {_format_of(f) for f, _ in under} - {None}
        if len(formats) > 1:  # format= would not help: one reader would get every file
            raise TextDataError(f"{path!r} mixes file formats ({', '.join(sorted(formats))}); the files of one path "
                                "must be of one format. Keep each format in a directory of its own, or list the "
                                "files as separate paths (data.source in a config takes a list of paths, each of "
                                "its own format)")
        if not formats and under:
            raise TextDataError(f"cannot tell the file format of {path!r}: no file ends in "
                                f"{', '.join(_FORMATS)} (optionally compressed, e.g. .jsonl.gz). Rename the files, "
                                "or in Python pass format='json', 'parquet', 'csv' or 'text'")
        if not formats:
            continue
        kind = formats.pop()
        files = [(f, size) for f, size in under if _format_of(f) == kind]
        if groups and groups[-1][0] == kind:
            groups[-1][1].extend(files)
        else:
            groups.append((kind, files))
    groups = [(kind, files) for kind, files in groups if any(size for _, size in files)]
    if not groups:
        raise EmptyDatasetError(f"every data file in {list(paths)} is empty")
    return groups


def _read_paths(paths: Sequence[str], format: str | None):
    parts = [_read_files(files, kind) for kind, files in plan_reads(paths, format)]
    if len(parts) == 1:
        return parts[0]
    # JSON reads give pandas blocks, Parquet reads Arrow ones, and a batch spanning both fails inside Ray Data:
    # every part is made Arrow in its read tasks.
    arrow = [part.map_batches(_as_is, batch_format="pyarrow", zero_copy_batch=True) for part in parts]
    return arrow[0].union(*arrow[1:])


def _as_is(batch):
    return batch


def _read_files(found: list[tuple[str, int]], format: str):
    """One Ray Data read of files in one format."""
    import ray.data

    files = [f for f, _ in found]
    if not any(storage.is_uri(f) for f in files) and _nodes_missing(found):
        files = ["local://" + os.path.abspath(f) for f in files]
    if format == "json":
        # JSON lines stream line by line; a plain .json may also be one top-level array.
        return ray.data.read_json(files, lines=_read_as_json_lines(files))
    if format == "parquet":
        return ray.data.read_parquet(files)
    if format == "text":
        return ray.data.read_text(files)  # one row per line, in column "text"
    if format == "csv":
        return ray.data.read_csv(files)  # a header row names the columns
    raise ValueError(f"unknown format {format!r}; use 'json', 'parquet', 'csv' or 'text'")


def _read_as_json_lines(files: Sequence[str]) -> bool:
    """JSON files are read line by line (pandas) when all are .jsonl, else by Arrow (which also reads a top-level
    array and objects spread over lines)."""
    return all(".jsonl" in f.split("?")[0].rsplit("/", 1)[-1].lower() for f in files)


def peek_columns_each(paths: Sequence[str], rows: int = 20,
                      max_files: int = 256) -> list[tuple[str, list[str]]] | None:
    """[(file, its columns)] for each of the first `max_files` local files of `paths`, read without Ray, so a
    config's columns are checked before Ray starts (later files' heads are read shorter). The columns of JSON lines
    are those of its first `rows` rows. Every file, not the first only: a shard whose text sits under another column
    name read as null text, and its rows were dropped without a word. None where the first file cannot be peeked
    cheaply (URIs, a .json array, a file that does not parse); later files that cannot are left out (reading them
    says why)."""
    found = local_files(paths)
    if found is None:
        return None
    peeked: list[tuple[str, list[str]]] = []
    lines = _read_as_json_lines([f for f in found if _format_of(f) == "json"])
    for file in [f for f in found if _format_of(f) is not None][:max_files]:
        columns = _columns_of(file, _format_of(file), rows, head_bytes=1 << 20 if not peeked else 1 << 16,
                              lines=lines)
        if columns is None and not peeked:
            return None
        if columns is not None:
            peeked.append((file, columns))
    return peeked


def local_files(paths: Sequence[str]) -> list[str] | None:
    """The non-empty files under local `paths`, for the driver's cheap reads; None for URIs (far away, maybe large)
    or paths it cannot list (reading them says why)."""
    if not paths or any(storage.is_uri(p) for p in paths):
        return None
    try:
        return [f for p in paths for f, size in _files_under(p) if size > 0]
    except OSError:
        return None


def _columns_of(file: str, format: str, rows: int, head_bytes: int, lines: bool = False) -> list[str] | None:
    """`lines`: JSON is read line by line, where a line that is not one JSON object (or a byte-order mark) fails the
    read, 20 s in: raised here instead."""
    import json

    import pyarrow as pa

    try:
        if format == "text":
            return ["text"]
        if format == "parquet":
            import pyarrow.parquet as pq

            return list(pq.ParquetFile(file).schema_arrow.names)
        if format == "csv":
            import pyarrow.csv as pcsv

            with pcsv.open_csv(file) as reader:  # reads the header and a first block only
                return list(reader.schema.names)
        with pa.input_stream(file, compression="detect") as stream:  # .jsonl.gz and the like too
            head = stream.read(head_bytes).decode("utf-8", errors="replace")
    except (OSError, ValueError, pa.ArrowException):
        return None
    if head.startswith("\ufeff"):
        if lines:
            raise TextDataError(f"{file} starts with a UTF-8 byte-order mark, which the JSON lines reader cannot "
                                "read. Save it as UTF-8 without one (Python: encoding='utf-8', not 'utf-8-sig').")
        head = head[1:]  # Arrow reads past it
    numbered = [(number, line) for number, line in
                enumerate(head.splitlines()[:-1 if len(head) == head_bytes else None], start=1) if line.strip()][:rows]
    try:
        parsed = [json.loads(line) for _, line in numbered]
    except ValueError:  # a .json holding one array (or broken JSON): left to the read
        if lines:
            number, exc = next((n, e) for n, e in ((n, _json_error(line)) for n, line in numbered) if e is not None)
            raise TextDataError(f"{BAD_ROW_FOUND}: {file}, line {number}: not a JSON object ({exc.msg}: column "
                                f"{exc.colno}). JSON lines files (.jsonl) hold one JSON object per line.") from None
        return None
    if not parsed or not all(isinstance(row, dict) for row in parsed):
        return None
    return sorted({name for row in parsed for name in row})


def _json_error(line: str):
    import json

    try:
        json.loads(line)
    except json.JSONDecodeError as exc:
        return exc
    return None


def _file_sizes(files: list[str]) -> list[int]:
    return [os.path.getsize(f) if os.path.isfile(f) else -1 for f in files]


def _nodes_missing(found: list[tuple[str, int]]) -> bool:
    """Whether some other node of the cluster lacks the local files found here (or holds other sizes there).

    Then Ray Data must read them on this node (`local://`), or its read tasks elsewhere would fail or read other
    data; when every node sees them (a shared filesystem), reads stay distributed. A tiny zero-CPU task per node
    asks; a driver node without CPUs for the reads is refused here rather than left waiting.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ray_jax_train.trainer import init_ray

    if not ray.is_initialized():
        if not os.environ.get("RAY_ADDRESS"):
            return False  # Ray will start here, on this one node
        init_ray()  # joins the cluster the reads will run on (what `ray job submit` sets up)
    here = ray.get_runtime_context().get_node_id()
    others = [node for node in ray.nodes() if node.get("Alive") and node["NodeID"] != here]
    if not others:
        return False
    files, sizes = [f for f, _ in found], [size for _, size in found]
    check = ray.remote(num_cpus=0)(_file_sizes)
    seen = ray.get([check.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
                    .remote([os.path.abspath(f) for f in files]) for node in others])
    missing = [node["NodeManagerAddress"] for node, got in zip(others, seen) if got != sizes]
    if not missing:
        return False
    this_node = next((node for node in ray.nodes() if node["NodeID"] == here), {})
    if this_node.get("Resources", {}).get("CPU", 0) < 1:
        raise ValueError(
            f"The data files {files[:3]}{'...' if len(files) > 3 else ''} are on this node only (nodes "
            f"{missing[:3]} lack them or hold other versions), and this node has no CPUs for Ray Data to read them. "
            "Put the data on storage every node sees (a shared filesystem, or a gs:// / s3:// URI).")
    return True


def _from_hf_dataset(source):
    """An in-memory/local HF ``Dataset`` as a Ray dataset, without touching the network.

    ``ray.data.from_huggingface`` first asks the Hub for parquet URLs (network, and an ``aiohttp``
    import that may not be installed) and only then falls back to the dataset's Arrow table; we go
    straight to that table. ``with_format("arrow")[:]`` applies any select/shuffle index mapping.
    """
    import ray.data

    return ray.data.from_arrow(source.with_format("arrow")[:])


def _from_hf_iterable(source):
    """A streaming HF ``IterableDataset``, read lazily in Ray Data's workers (see ``hf_stream`` for why ours)."""
    import ray.data

    from .hf_stream import HFStreamDatasource

    return ray.data.read_datasource(HFStreamDatasource(source))


def load_text_dataset(source: Any, *, format: str | None = None):
    """Return ``source`` as a ``ray.data.Dataset``.

    Accepts a ``ray.data.Dataset`` (returned as is), a Hugging Face ``datasets.Dataset`` (its
    Arrow table) or ``IterableDataset`` (streamed), a list of row dicts, or local
    file/directory path(s) of ``.jsonl`` (JSON lines), ``.json`` (lines or one array),
    ``.parquet``, ``.csv`` (a header row names the columns) or ``.txt`` (one row per line, column ``text``). ``format`` overrides the suffix-based guess.
    Paths may be URIs (``gs://``, ``s3://``, ``file://``). Local paths are checked here, on the driver; on a
    cluster of several nodes they are also read here.
    """
    import ray.data

    if isinstance(source, ray.data.Dataset):
        return source
    try:
        import datasets as hf_datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        hf_datasets = None
    if hf_datasets is not None:
        if isinstance(source, (hf_datasets.DatasetDict, hf_datasets.IterableDatasetDict)):
            raise ValueError(f"got a DatasetDict with splits {list(source.keys())}; pass one split, "
                             f"e.g. source['train']")
        if isinstance(source, hf_datasets.Dataset):
            if len(source) == 0:
                raise EmptyDatasetError("the Hugging Face dataset has no rows")
            return _from_hf_dataset(source)
        if isinstance(source, hf_datasets.IterableDataset):
            return _from_hf_iterable(source)
    if isinstance(source, (str, os.PathLike)):
        return _read_paths([os.fspath(source)], format)
    if isinstance(source, (list, tuple)):
        if not source:
            raise EmptyDatasetError("the source list is empty")
        if all(isinstance(x, dict) for x in source):
            return ray.data.from_items(list(source))
        if all(isinstance(x, (str, os.PathLike)) for x in source):
            return _read_paths([os.fspath(x) for x in source], format)
    raise TypeError(f"unsupported text source of type {type(source).__name__}; pass a ray.data.Dataset, "
                    f"a datasets.Dataset, a list of row dicts, or .jsonl/.parquet/.txt path(s) or URI(s)")


def extract_column_names(dataset: Any) -> list[str] | None:
    """Column names of a Hugging Face or Ray dataset (or DataFrame / dict of columns); None if unknown.

    A Ray dataset's schema may need to execute the first block, so this can cost a little work.
    """
    try:
        import ray.data

        if isinstance(dataset, ray.data.Dataset):
            schema = dataset.schema()
            return None if schema is None else list(schema.names)
    except ImportError:  # pragma: no cover
        pass
    try:
        import datasets as hf_datasets

        if isinstance(dataset, (hf_datasets.DatasetDict, hf_datasets.IterableDatasetDict)):
            raise ValueError(f"got a DatasetDict with splits {list(dataset.keys())}; pass one split")
        if isinstance(dataset, (hf_datasets.Dataset, hf_datasets.IterableDataset)):
            if dataset.column_names is not None:
                return list(dataset.column_names)
            return None if dataset.features is None else list(dataset.features)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(dataset, dict):
        return list(dataset)
    columns = getattr(dataset, "columns", None)  # pandas / pyarrow
    if columns is not None:
        return [str(c) for c in columns]
    column_names = getattr(dataset, "column_names", None)
    if column_names is not None:
        return list(column_names)
    raise TypeError(f"cannot read column names from a {type(dataset).__name__}")


def resolve_column(columns: Sequence[str] | None, text_column: str,
                   messages_column: str | None) -> tuple[str, str] | None:
    """Pick ("messages"|"text", column name); messages win when both exist (`messages_column=None` reads text
    only). None if columns unknown."""
    if columns is None:
        return None
    if messages_column is not None and messages_column in columns:
        return "messages", messages_column
    if text_column in columns:
        return "text", text_column
    raise MissingColumnError(
        f"the dataset has neither a text column {text_column!r} nor a messages column "
        f"{messages_column!r}; its columns are {list(columns)}. Name the right one with training.text_column or "
        f"training.messages_column in the config (text_column=... or messages_column=... in Python).")
