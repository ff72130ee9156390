"""Driver-side data preparation: any source -> a Ray dataset of packed rows, plus the columns the loop feeds.

Tokenisation and packing run in Ray Data `map_batches` (the text package), never in the train loop, so the
workers only turn ready int32 rows into global arrays. Problems the driver can see (missing column, empty
data, no chat template) raise here, before any worker starts.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from ray_jax_train.lm.arguments import TrainingArguments

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

REQUIRED = ("input_ids", "targets", "loss_mask")
OPTIONAL = ("attention_mask", "segment_ids", "positions")


def prepare_lm_dataset(source: Any, tokenizer, args: TrainingArguments, *, max_position_embeddings: Optional[int] = None,
                       data_collator: Optional[Callable] = None, what: str = "dataset_train",
                       vocab_size: Optional[int] = None) -> Tuple[Any, List[str]]:
    """Return (ray dataset of rows with input_ids/targets/loss_mask[/segment_ids/positions], columns to feed).

    `source` may be a Ray dataset, a Hugging Face dataset, a list of row dicts or local .jsonl/.parquet/.txt
    files. Rows that already carry `input_ids`, `targets` and `loss_mask` (pre-tokenised, fixed length) are
    used as they are; raw text or chat `messages` are tokenised and packed to `max_sequence_length`.
    `data_collator`, if given, is applied to the packed rows with `map_batches(batch_format="numpy")`.
    """
    from ray_jax_train import text

    if source is None:
        raise ValueError(f"{what} is None; pass a Ray dataset, a Hugging Face dataset, row dicts or file paths.")
    try:
        dataset = text.load_text_dataset(source)
        names = text.extract_column_names(dataset)
    except text.TextDataError as exc:
        raise type(exc)(f"{what}: {exc}") from None
    if names is not None and all(name in names for name in REQUIRED):
        first = dataset.take(1)
        if not first:
            raise text.EmptyDatasetError(f"{what}: the dataset has no rows")
        _check_padding_segment(first[0], what)
        packed = dataset
        if data_collator is None:  # a collator may reshape or remap rows: what it feeds is then its own affair
            _check_pretokenised_row(first[0], args.max_sequence_length, vocab_size, what)
            if vocab_size is not None:
                packed = _check_every_row(dataset, vocab_size, what)
    else:
        if names is not None and "input_ids" in names and args.text_column not in names \
                and args.messages_column not in names:
            missing = [name for name in REQUIRED if name not in names]
            raise text.MissingColumnError(
                f"{what} holds token ids (input_ids) without {' and '.join(missing)}: pre-tokenised rows need "
                f"{', '.join(REQUIRED)}, each max_sequence_length={args.max_sequence_length} long. Pack token lists "
                "of any length into such rows with ray_jax_train.pack_documents, or give the raw text instead.")
        if tokenizer is None:
            raise ValueError(f"{what} holds raw text (columns {names}) but no tokenizer is available; give the "
                             "trainer a local tokenizer/model directory or pre-tokenised rows.")
        try:
            packed = text.tokenize_and_pack(
                dataset, tokenizer, args.max_sequence_length, text_column=args.text_column,
                messages_column=args.messages_column, max_position_embeddings=max_position_embeddings,
                truncation=True)
        except text.TextDataError as exc:
            raise type(exc)(f"{what}: {exc}") from None
        names = list(text.PACKED_KEYS)
    if data_collator is not None:
        packed = packed.map_batches(data_collator, batch_format="numpy")
        names = text.extract_column_names(packed)
    missing = [name for name in REQUIRED if name not in (names or [])]
    if missing:
        raise text.MissingColumnError(f"{what}: the rows fed to the model lack {missing} (columns: {names}).")
    return packed, [name for name in REQUIRED + OPTIONAL if name in names]


def prepare_lm_datasets(train_source: Any, eval_source: Any, tokenizer, args: TrainingArguments, *,
                        max_position_embeddings: Optional[int] = None, data_collator: Optional[Callable] = None,
                        materialize: bool = False, names: Tuple[str, str] = ("dataset_train", "dataset_eval"),
                        vocab_size: Optional[int] = None,
                        prepared: Optional[Tuple[Dict[str, Any], List[str]]] = None,
                        ) -> Tuple[Dict[str, Any], List[str], int]:
    """(datasets {"train"[, "eval"]}, the columns to feed, the run's total steps) for the built-in loop.

    The one driver-side path that every entry point (Python API, JSON config, CLI, Tune trials) takes, so each
    gets the same checks before a worker starts: eval rows must feed the same columns, and warmup must fit.
    The datasets are materialised (tokenised now) when asked, when counting rows is the only way to know the
    step count (num_epochs), or when the workers would hold every CPU and starve the Ray Data tasks (a hang).
    `prepared`: what `tokenize_lm_datasets` made of these sources for these data settings already (a Tune search
    makes it once on its driver); only the run's steps are counted and checked then.
    """
    from ray.data.dataset import MaterializedDataset

    if args.total_steps is not None and args.num_epochs is not None:
        logger.warning("num_epochs=%d is ignored: total_steps=%d sets the run's length. To train by epochs, leave "
                       "total_steps out (in a CLI config: --set training.total_steps=null).", args.num_epochs,
                       args.total_steps)
    if prepared is None:
        datasets, columns = tokenize_lm_datasets(
            train_source, eval_source, tokenizer, args, max_position_embeddings=max_position_embeddings,
            data_collator=data_collator, materialize=materialize, names=names, vocab_size=vocab_size)
    else:
        datasets, columns = dict(prepared[0]), list(prepared[1])
    if "eval" not in datasets and args.eval_steps:
        eval_name = "data.eval_source or data.eval_fraction" if names[1] == "data.eval_source" else names[1]
        logger.warning("eval_steps=%d is set, but there is no eval data: nothing will be evaluated. Give %s, or "
                       "leave eval_steps out.", args.eval_steps, eval_name)
    if args.total_steps is None:
        rows = datasets["train"].count()
        total_steps = args.steps_for_rows(rows)
        _say_rows_left_out(rows, args.batch_size)
    else:
        total_steps = args.total_steps
        if isinstance(datasets["train"], MaterializedDataset):  # counted for free: too little fails here,
            args.steps_for_rows(datasets["train"].count())               # not in the workers after compiling
    if args.warmup_steps > total_steps:
        raise ValueError(f"warmup_steps={args.warmup_steps} exceeds the {total_steps} training steps; lower "
                         "warmup_steps or train longer.")
    args.check_profile_window(total_steps)
    return datasets, columns, total_steps


def tokenize_lm_datasets(train_source: Any, eval_source: Any, tokenizer, args: TrainingArguments, *,
                         max_position_embeddings: Optional[int] = None, data_collator: Optional[Callable] = None,
                         materialize: bool = False, names: Tuple[str, str] = ("dataset_train", "dataset_eval"),
                         vocab_size: Optional[int] = None) -> Tuple[Dict[str, Any], List[str]]:
    """(datasets {"train"[, "eval"]}, the columns to feed): the sources tokenised, packed and checked.

    What it makes depends on the sources, the tokenizer, the model's vocabulary and positions, and the data settings
    of `args` (max_sequence_length, the text/messages columns, num_workers, which the eval rows are padded to), not
    on how long or how fast the run trains: runs that differ only in those can share it.
    """
    from ray.data.dataset import MaterializedDataset

    if vocab_size is not None:
        check_tokenizer_fits(tokenizer, vocab_size)
    columns_of = dict(text_column=args.text_column, messages_column=args.messages_column)
    with naming_the_bad_row(train_source, names[0], **columns_of):
        train_ds, columns = prepare_lm_dataset(train_source, tokenizer, args, data_collator=data_collator,
                                               max_position_embeddings=max_position_embeddings, what=names[0],
                                               vocab_size=vocab_size)
    datasets = {"train": train_ds}
    if eval_source is not None:
        with naming_the_bad_row(eval_source, names[1], **columns_of):
            datasets["eval"], eval_columns = prepare_lm_dataset(
                eval_source, tokenizer, args, data_collator=data_collator, what=names[1],
                max_position_embeddings=max_position_embeddings, vocab_size=vocab_size)
        if eval_columns != columns:
            raise ValueError(f"{names[1]} feeds columns {eval_columns}, {names[0]} {columns}; they must match.")
    sources = {"train": (train_source, names[0]), "eval": (eval_source, names[1])}
    tokenise_now = [name for name in datasets if materialize or args.total_steps is None or _too_few_cpus(args)
                    # Eval runs again and again over the same few rows: tokenise them once (and count them, below).
                    or name == "eval"]
    for name in tokenise_now:
        with naming_the_bad_row(*sources[name], **columns_of):
            datasets[name] = _in_order(datasets[name])
    _check_eval_rows(datasets.get("eval"), args, names[1])
    if "eval" in datasets:
        datasets["eval"] = _padded_to_workers(datasets["eval"], args.num_workers)
    if isinstance(datasets["train"], MaterializedDataset) and not _loss_tokens(datasets["train"]):
        from ray_jax_train.lm.loop import NoLossTokensError

        raise NoLossTokensError(f"{names[0]}: no token of any row counts for the loss (loss_mask is 0 everywhere), so "
                                "the model would learn nothing. Chat data needs assistant turns with content (only "
                                "their tokens are trained on); pre-tokenised rows need loss_mask 1 on the tokens to "
                                "learn.")
    return datasets, columns


def source_paths(source: Any) -> List[str]:
    """The local file paths or URIs a source names ([] for datasets and rows in memory)."""
    import os

    if isinstance(source, (str, os.PathLike)):
        return [os.fspath(source)]
    if isinstance(source, (list, tuple)) and source and all(isinstance(x, (str, os.PathLike)) for x in source):
        return [os.fspath(x) for x in source]
    return []


@contextlib.contextmanager
def naming_the_bad_row(source: Any, what: str, *, text_column: str = "text", messages_column: str = "messages"):
    """A Ray Data task that fails on a row of `source`'s files is re-raised naming the file and line of the first
    bad row (Ray's own error names neither: "Unexpected character ... at position 39468")."""
    import ray.exceptions

    from ray_jax_train.text.errors import TextDataError, read_error
    from ray_jax_train.text.locate import where_the_bad_row_is

    try:
        yield
    except (ray.exceptions.RayTaskError, TextDataError) as exc:
        paths = source_paths(source)
        if not paths:
            raise
        # Ray's errors (also a RayTaskError(TextDataError) from a Ray Data task) name nothing and carry a traceback;
        # our own, from the driver's first-row checks, already name the dataset.
        from_ray = isinstance(exc, ray.exceptions.RayTaskError)
        said = f"{what}: {read_error(exc)}" if from_ray else str(exc)
        where = where_the_bad_row_is(said, paths, text_column=text_column, messages_column=messages_column)
        if not where:
            raise
        raise (TextDataError if from_ray else type(exc))(said + where) from exc


def _say_rows_left_out(rows: int, batch_size: int) -> None:
    """Each epoch trains whole global batches: the rows past the last one sit out every epoch. Said, loudly when
    they are a tenth of the data or more (a small set with a large batch)."""
    left_out = rows % batch_size
    if left_out:
        level = logging.WARNING if left_out * 10 >= rows else logging.INFO
        logger.log(level, "%d of the %d packed training rows are left out of every epoch: each epoch trains whole "
                   "global batches of %d. A batch_size that divides the row count trains on all of them.",
                   left_out, rows, batch_size)


def _loss_tokens(dataset) -> int:
    """Tokens counted for the loss in a materialized dataset: one pass of Ray Data tasks over the object store,
    which tells on the driver what the loop would otherwise find only after 20 steps."""
    import numpy as np

    counts = dataset.map_batches(lambda rows: {"n": [int(np.count_nonzero(_flat(rows["loss_mask"])))]},
                                 batch_format="numpy", zero_copy_batch=True)
    return sum(int(row["n"]) for row in counts.take_all())


def check_tokenizer_fits(tokenizer, vocab_size: int) -> None:
    """Every id the tokenizer can give, padding included, must have a row in the embedding: JAX gathers NaN for
    an id past the table instead of failing, and the NaN spreads through attention to the whole batch."""
    if tokenizer is None:
        return
    largest = max([len(tokenizer) - 1] + [i for i in (tokenizer.pad_token_id,) if i is not None])
    if largest >= vocab_size:
        raise ValueError(f"The tokenizer gives ids up to {largest} (pad_token_id={tokenizer.pad_token_id}, "
                         f"{len(tokenizer)} tokens) but the model's vocab_size is {vocab_size}. Give the model a "
                         "vocab_size of at least len(tokenizer), or use the tokenizer it was trained with.")


def _check_padding_segment(row: Dict[str, Any], what: str) -> None:
    """Pre-tokenised rows follow our packing: segment id 0 is padding, which attends to nothing else. Rows that
    number their first document 0 would train it without context; said here, on a row the driver has anyway."""
    import numpy as np

    if "segment_ids" not in row:
        return
    _mask_of(row, what)  # first: Hugging Face's -100 labels as the mask would read as trained padding
    trained_padding = (np.asarray(row["segment_ids"]) == 0) & (np.asarray(row["loss_mask"]) != 0)
    if trained_padding.any():
        raise ValueError(f"{what}: a row has loss_mask 1 where segment_ids is 0, which marks padding; number the "
                         "documents of a row from 1 (as ray_jax_train.text.pack_documents does).")


def _check_pretokenised_row(row: Dict[str, Any], max_sequence_length: int, vocab_size: Optional[int],
                            what: str) -> None:
    """Pre-tokenised rows skip the tokenizer check, so their ids meet the vocabulary here: one id past the
    embedding table gathers NaN, which attention spreads over its whole row, and the loss goes NaN with no cause
    in sight. Their length must be the run's `max_sequence_length`, which tokens/s, MFU and the `sp` split use."""
    import numpy as np

    lengths = {name: int(np.asarray(row[name]).shape[-1]) for name in REQUIRED + OPTIONAL if name in row}
    wrong = {name: n for name, n in lengths.items() if n != max_sequence_length}
    if wrong:
        raise ValueError(f"{what}: pre-tokenised rows have lengths {wrong}, but max_sequence_length is "
                         f"{max_sequence_length}. Set max_sequence_length to the rows' length, or pack them to "
                         f"{max_sequence_length} tokens.")
    if vocab_size is not None:
        _ids_in_vocabulary(row, vocab_size, what)


def _check_every_row(dataset, vocab_size: int, what: str):
    """The dataset to feed, its rows' ids checked against the vocabulary (the driver read only the first).

    Rows already in the object store are checked now, in one pass of Ray Data tasks that return nothing, so the
    dataset fed stays materialized (counted, and needing no CPU while training). Rows still to be read are checked
    as they are read, by a map fused into the read tasks: no second pass over files.
    """
    from ray.data.dataset import MaterializedDataset

    check = functools.partial(_ids_in_vocabulary, vocab_size=vocab_size, what=what)
    if isinstance(dataset, MaterializedDataset):
        dataset.map_batches(lambda rows: {"rows": [len(check(rows)["input_ids"])]}, batch_format="numpy",
                            zero_copy_batch=True).count()
        return dataset
    return dataset.map_batches(check, batch_format="numpy", zero_copy_batch=True)


def in_order_split():
    """The trainer's DataConfig for prepared data: each worker's shard holds the same rows in the same order every
    run. Ray Train's default replaced the datasets' own `preserve_order` with the driver's (off), and then handed
    each worker the blocks it asked for first: about 1 fresh 2-worker run in 4 trained on other batches from step 1
    (a review)."""
    import warnings

    from ray.train import DataConfig

    with warnings.catch_warnings():  # Ray's own default passes the option it deprecates: a warning no user can act on
        warnings.filterwarnings("ignore", message=r".*exclude_resources.* is deprecated")
        options = DataConfig.default_ingest_options()
    options.preserve_order = True
    return DataConfig(execution_options=options)


def _in_order(dataset):
    """`dataset` tokenised now, its rows in the source's order whatever task finished first: two runs of one config
    (Tune trials, a rerun) then see the same batches, and differ only in what their settings change."""
    dataset.context.execution_options.preserve_order = True  # the dataset's own copy of Ray Data's context
    return dataset.materialize()


def _flat(column) -> np.ndarray:
    """A column's values in one 1-D array: a 2-D tensor column, or Ray's object array of per-row lists (rows read
    from JSON, Parquet or Python lists)."""
    import numpy as np

    column = np.asarray(column)
    if column.dtype == object:
        return np.concatenate([np.asarray(item).ravel() for item in column]) if column.size else np.zeros(0, int)
    return column.ravel()


def _mask_of(rows: Dict[str, Any], what: str) -> np.ndarray:
    """`rows`' loss_mask values, flat, refused unless 0/1."""
    import numpy as np

    mask = _flat(rows["loss_mask"])
    if mask.size and not np.isin(mask, (0, 1)).all():
        raise ValueError(f"{what}: a pre-tokenised row has loss_mask values "
                         f"{sorted(set(np.unique(mask).tolist()) - {0, 1})[:5]}; it must be 0 or 1 (1: the token's "
                         "target is trained). From Hugging Face labels: targets = the labels shifted left by one, "
                         "loss_mask = (targets != -100).")
    return mask


def _ids_in_vocabulary(rows: Dict[str, Any], vocab_size: int, what: str) -> Dict[str, Any]:
    """`rows` (one row or a numpy batch), unchanged, once their ids are known to have rows in the embedding and
    their loss_mask to be 0/1 (the loss weighs tokens by it: Hugging Face's -100 labels there trained a negative
    loss over a negative token count)."""
    mask = _mask_of(rows, what)
    ids = _flat(rows["input_ids"])
    targets = _flat(rows["targets"])[mask != 0]  # masked targets are never read
    for name, values in (("input_ids", ids), ("targets", targets)):
        if values.size and (values.min() < 0 or values.max() >= vocab_size):
            raise ValueError(f"{what}: a pre-tokenised row has {name} from {values.min()} to {values.max()}, "
                             f"outside the model's vocabulary [0, {vocab_size}); JAX would read NaN for them and "
                             "the loss would go NaN. Tokenize with the model's own tokenizer, or give the model a "
                             "vocab_size above the largest id.")
    return rows


def _check_eval_rows(eval_ds, args: TrainingArguments, name: str) -> None:
    """Ray splits an eval set equally, rows // workers to each: fewer rows than workers would evaluate
    nothing (no eval_loss, found only when a Tune search on it ends)."""
    from ray.data.dataset import MaterializedDataset

    if not isinstance(eval_ds, MaterializedDataset):
        return
    rows = eval_ds.count()
    if rows < args.num_workers:
        raise ValueError(f"{name} packs into {rows} rows of {args.max_sequence_length} tokens, fewer than the "
                         f"{args.num_workers} workers; Ray gives each worker rows // workers of them, so nothing "
                         "would be evaluated. Give more eval text, or fewer workers.")


def _padded_to_workers(eval_ds, workers: int):
    """The (materialized) eval rows, followed by rows that count for nothing (loss_mask 0) up to a multiple of the
    workers. Ray splits an eval set equally, rows // workers to each: the rest were left out of eval_loss without a
    word, so it moved with the worker count (a review: 1 of 7 rows left out with 2 workers)."""
    short = -eval_ds.count() % max(workers, 1)
    if not short:
        return eval_ds
    # Both parts through one numpy map, so their blocks agree: rows given as lists (or read from JSON lines) and
    # padding built from arrays made a union that failed where a batch spanned the two (a review).
    rows = eval_ds.map_batches(_rows_as_arrays, batch_format="numpy")
    blanks = [eval_ds.limit(1).map_batches(_rows_as_arrays, fn_kwargs={"blank": True}, batch_format="numpy")
              for _ in range(short)]
    return _in_order(rows.union(*blanks))


def _rows_as_arrays(batch: Dict[str, Any], blank: bool = False) -> Dict[str, Any]:
    """A numpy batch with its per-row lists stacked into 2-D arrays; `blank`: loss_mask zeroed."""
    import numpy as np

    out = {}
    for name, column in batch.items():
        if column.dtype == object:
            try:
                column = np.stack([np.asarray(value) for value in column])
            except ValueError:  # ragged, or not numbers: left as it is
                pass
        out[name] = np.zeros_like(column) if blank and name == "loss_mask" else column
    return out


def _too_few_cpus(args: TrainingArguments) -> bool:
    """Whether streaming the text pipeline during training could starve: it wants CPUs for its read and tokenizing
    tasks beside the workers' own (a tokenizing actor, `concurrency=N`, holds one for the whole run: with 1 spare
    CPU the read task never ran)."""
    import ray
    from ray.train import ScalingConfig

    from ray_jax_train.trainer import worker_cpus

    workers = args.num_workers * worker_cpus(ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu))
    return ray.is_initialized() and ray.cluster_resources().get("CPU", 0) < workers + 2
