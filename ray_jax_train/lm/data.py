"""Driver-side data preparation: any source -> a Ray dataset of packed rows, plus the columns the loop feeds.

Tokenisation and packing run in Ray Data `map_batches` (the text package), never in the train loop, so the
workers only turn ready int32 rows into global arrays. Problems the driver can see (missing column, empty
data, no chat template) raise here, before any worker starts.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

from ray_jax_train.lm.arguments import TrainingArguments

REQUIRED = ("input_ids", "targets", "loss_mask")
OPTIONAL = ("attention_mask", "segment_ids", "positions")


def prepare_lm_dataset(source: Any, tokenizer, args: TrainingArguments, *, max_position_embeddings: Optional[int] = None,
                       data_collator: Optional[Callable] = None, what: str = "dataset_train") -> Tuple[Any, List[str]]:
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
        if not dataset.take(1):
            raise text.EmptyDatasetError(f"{what}: the dataset has no rows")
        packed = dataset
    else:
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
