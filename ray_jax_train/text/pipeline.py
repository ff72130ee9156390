"""Ray Data wiring: tokenise and pack on Ray Data's CPU workers, never in the train loop.

Each ``map_batches`` call takes a batch of raw rows (text or chat messages) and returns packed
rows (see ``packing.py``); a batch is the packing window, so a larger ``batch_size`` wastes
fewer tokens on padding at the end of each window. The tokenizer is loaded once per worker process,
from a local directory or from one copy in the object store, not shipped with every batch.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .encode import check_roles, encode_chats, encode_texts
from .errors import EmptyDatasetError, MissingColumnError, TextDataError
from .packing import pack_documents
from .sources import extract_column_names, load_text_dataset, resolve_column
from .tokenizer import check_chat_template, ensure_pad_token, load_tokenizer


def _batch_columns(batch: Any) -> list[str]:
    if isinstance(batch, Mapping):
        return list(batch)
    return list(getattr(batch, "column_names", None) or batch.columns)  # pyarrow.Table or pandas


def _column_values(batch: Any, name: str) -> list:
    names = _batch_columns(batch)
    if name not in names:
        raise MissingColumnError(f"column {name!r} is missing from the batch; its columns are {names}")
    values = batch[name]
    if hasattr(values, "to_pylist"):
        return values.to_pylist()
    return list(values.tolist() if isinstance(values, np.ndarray) else values)


def _filled(value: Any) -> bool:
    # Empty text or conversation: TokenizeAndPack makes no document of it.
    return value is not None and (not hasattr(value, "__len__") or len(value) > 0)


def _has_document(row: Mapping[str, Any], *, text_column: str, messages_column: str) -> bool:
    return _filled(row.get(messages_column)) or _filled(row.get(text_column))


class TokenizeAndPack:
    """Ray Data callable class: raw rows in, packed ``seq_len`` rows out (see ``packing.py``).

    ``tokenizer`` is a tokenizer, a local directory to load one from, or ``[ObjectRef]`` to one;
    it is resolved once in ``__init__``, i.e. once per Ray Data actor. Each batch is read by its own columns
    (messages win over text), so ``kind`` is accepted and no longer used.
    """

    def __init__(self, tokenizer, seq_len: int, *, text_column: str = "text",
                 messages_column: str = "messages", kind: str | None = None, add_bos: bool = True,
                 max_position_embeddings: int | None = None, truncation: bool = False,
                 pad_id: int | None = None):
        import ray

        if isinstance(tokenizer, list):  # [ObjectRef], see tokenize_and_pack
            tokenizer = ray.get(tokenizer[0])
        self.tokenizer = load_tokenizer(tokenizer)
        self.seq_len = seq_len
        self.text_column = text_column
        self.messages_column = messages_column
        self.add_bos = add_bos
        self.max_position_embeddings = max_position_embeddings
        self.truncation = truncation
        self.pad_id = pad_id if pad_id is not None else ensure_pad_token(self.tokenizer).pad_token_id

    def __call__(self, batch: Any) -> dict[str, np.ndarray]:
        # Each batch by its own columns, not by the kind the driver saw in the first row: a directory of text files
        # and chat files (or a source list of both) reads as text-only batches, chat-only ones, and batches joined
        # across the two with the other column null. A kind fixed from the first file dropped every conversation
        # of a joined batch, silently, and failed on a batch without its column (a text pipeline review).
        kind, _ = resolve_column(_batch_columns(batch), self.text_column, self.messages_column)
        if kind == "messages":
            conversations = _column_values(batch, self.messages_column)
            docs, masks = encode_chats(self.tokenizer, [c for c in conversations if c])
            if self.text_column in _batch_columns(batch):
                # A file that mixes text rows and chat rows reads as one table with both columns, the text rows'
                # messages null: those rows are text documents (loss on every token), not dropped.
                texts = [t for t, c in zip(_texts(_column_values(batch, self.text_column), self.text_column),
                                           conversations) if t and not c]
                text_docs = encode_texts(self.tokenizer, texts, add_bos=self.add_bos)
                docs += text_docs
                masks += [np.ones(len(d), dtype=np.int32) for d in text_docs]
        else:
            texts = [t for t in _texts(_column_values(batch, self.text_column), self.text_column) if t]  # "": none
            docs, masks = encode_texts(self.tokenizer, texts, add_bos=self.add_bos), None
        return pack_documents(docs, self.seq_len, label_masks=masks, pad_id=self.pad_id,
                              max_position_embeddings=self.max_position_embeddings,
                              truncation=self.truncation)


def _texts(values, column: str) -> list:
    """A text column's values with null as "": Ray Data reads a shard whose text is null in every row as NaN once it
    meets the others (NaN passed `if t` and failed in the tokenizer naming nothing). Any other non-string (ints, a
    list) is refused, naming the column."""
    out = []
    for value in values:
        if value is None or (isinstance(value, float) and value != value):
            out.append("")
        elif isinstance(value, str):
            out.append(value)
        else:
            raise TextDataError(
                f"column {column!r} holds {'an' if type(value).__name__[0] in 'aeiou' else 'a'} "
                f"{type(value).__name__} ({value!r:.60}), not text: a file whose "
                f"{column!r} is numbers or lists? Convert it to strings, leave that file out, or name the right "
                "column with training.text_column (text_column= in Python).")
    return out


def tokenize_and_pack(dataset, tokenizer, seq_len: int, *, text_column: str = "text",
                      messages_column: str = "messages", add_bos: bool = True,
                      max_position_embeddings: int | None = None, truncation: bool = False,
                      batch_size: int = 1024, concurrency: int | tuple[int, int] | None = None,
                      num_cpus: float = 1, check_not_empty: bool = True):
    """Return a Ray dataset of packed rows built from ``dataset``'s text or messages column.

    Problems visible from the driver (missing column, empty dataset or no row with text, messages
    without a usable chat template) raise here, before any worker starts.
    A messages column wins over a text column when both exist; a row whose messages are empty then falls back
    to its text (a file mixing both kinds of rows). Text documents are
    ``[bos] + tokens + eos`` (``add_bos``); chat documents are whatever the chat template renders,
    with loss on assistant tokens only. ``max_position_embeddings`` caps document length (cut
    with ``truncation=True``, else ``SequenceTooLongError`` from the worker); without it nothing
    is cut. ``concurrency`` is the number of tokenising actors, or (min, max) to autoscale; None (the
    default) tokenises in Ray tasks instead, at most ``TOKENIZING_TASKS`` at once, which run in Ray's pooled worker
    processes: an actor is a process started for it, ~1 s of every run's start-up per dataset. ``batch_size`` rows
    form one packing window (a task step may be fused with a ``map_batches`` chained after it with another batch
    size, or split per block before a shuffle, which moves the windows; the actor pool's never are).
    """
    import ray
    import ray.data

    tok = load_tokenizer(tokenizer)
    pad_id = ensure_pad_token(tok).pad_token_id
    if check_not_empty:
        # One small execution answers both questions: is there a row, and what are the columns.
        first = dataset.take(1)
        if not first:
            raise EmptyDatasetError("the dataset has no rows")
        columns = list(first[0])
    else:
        columns = extract_column_names(dataset)
    resolved = resolve_column(columns, text_column, messages_column)
    kind = resolved[0] if resolved else None
    if check_not_empty:
        _check_some_document(dataset, first[0], columns, resolved, text_column=text_column,
                             messages_column=messages_column)
    if kind == "messages":
        check_chat_template(tok)
    if check_not_empty and resolved:
        _check_first_document(dataset, first[0], tok, resolved, text_column=text_column,
                              messages_column=messages_column)
        if kind == "messages":
            _warn_about_sampled_conversations(dataset, tok, seq_len, messages_column, text_column)
    # One copy in the object store, fetched once per worker process (or actor), even when given as a path: they
    # may run on nodes that do not have the driver's directory. The ref is nested in a list so Ray passes it as it
    # is (an actor's constructor args stay inlined, keeping restarts possible) instead of resolving it per call.
    handle = [ray.put(tok)]
    settings = dict(text_column=text_column, messages_column=messages_column, add_bos=add_bos,
                    max_position_embeddings=max_position_embeddings, truncation=truncation, pad_id=pad_id)
    if concurrency is None:
        return dataset.map_batches(_tokenize_and_pack_batch, batch_size=batch_size, batch_format="pyarrow",
                                   num_cpus=num_cpus, compute=ray.data.TaskPoolStrategy(size=TOKENIZING_TASKS),
                                   fn_kwargs=dict(handle=handle, seq_len=seq_len, **settings))
    if isinstance(concurrency, tuple):
        compute = ray.data.ActorPoolStrategy(min_size=concurrency[0], max_size=concurrency[1])
    else:
        compute = ray.data.ActorPoolStrategy(size=concurrency)
    return dataset.map_batches(
        TokenizeAndPack, batch_size=batch_size, batch_format="pyarrow", compute=compute, num_cpus=num_cpus,
        fn_constructor_args=(handle, seq_len), fn_constructor_kwargs=settings)


# Tokenizing tasks of one dataset at once: the tokenizer's own thread pool already spreads a batch over the cores,
# and each task process holds a tokenizer (an HF one can be 100 MB); the actor pool this replaced was one process.
TOKENIZING_TASKS = 4

# The tokenizing callable of the last tokenizer in the object store that this pooled worker process used: loaded at
# its first batch, not at every batch. One: a process kept a copy per dataset (train, eval, each run's) for good.
_worker_tokenizer: dict = {}


def _tokenize_and_pack_batch(batch, *, handle, seq_len: int, **settings):
    key = (handle[0].hex(), seq_len, tuple(sorted(settings.items())))
    step = _worker_tokenizer.get(key)
    if step is None:
        _worker_tokenizer.clear()
        step = _worker_tokenizer[key] = TokenizeAndPack(handle, seq_len, **settings)
    return step(batch)


def _check_some_document(dataset, first_row: Mapping[str, Any], columns: list[str], resolved: tuple[str, str],
                         **names) -> None:
    """Rows that are all empty pack to no rows at all, which the training loop would only meet as a dataset too
    small for one batch. Scans past the first row only when that one is empty, so usual data costs nothing more."""
    import functools

    if _has_document(first_row, **names):
        return
    if dataset.filter(functools.partial(_has_document, **names)).take(1):
        return
    kind, column = resolved
    what = "a non-empty conversation" if kind == "messages" else "non-empty text"
    raise EmptyDatasetError(
        f"no row has {what} in column {column!r} (the dataset's columns are {columns}), so there is nothing to "
        f"train on. If it is in another column, name that column with training.{kind}_column in the config "
        f"({kind}_column=... in Python); otherwise fill the {column!r} column or use other data.")


def _check_first_document(dataset, first_row: Mapping[str, Any], tokenizer, resolved: tuple[str, str],
                          **names) -> None:
    """The first document's type (and a conversation's roles) on the driver: a wrong column failed only in the
    tokenising actors, after the workers had started, naming no column."""
    kind, column = resolved
    row = first_row if _has_document(first_row, **names) else dataset.filter(
        lambda r: _has_document(r, **names)).take(1)[0]
    value = row.get(column)
    if not _filled(value):  # this row's document is in the other column (a file mixing both kinds)
        return
    if kind == "text" and not isinstance(value, str):
        looks_like_chat = isinstance(value, (list, tuple)) or hasattr(value, "tolist")
        raise TextDataError(
            f"column {column!r} holds {type(value).__name__} values ({value!r:.80}), not text. "
            + ("If it holds conversations, name it with training.messages_column in the config (messages_column=... "
               "in Python)." if looks_like_chat else
               "Name the column that holds the text with training.text_column in the config (text_column=... in "
               "Python)."))
    if kind == "messages":
        conversation = value.tolist() if hasattr(value, "tolist") else value
        if not isinstance(conversation, (list, tuple)) or not all(isinstance(m, Mapping) for m in conversation):
            raise TextDataError(
                f"column {column!r} holds {type(value).__name__} values ({value!r:.80}), not conversations (lists of "
                "{'role': ..., 'content': ...}). If it holds text, name it with training.text_column in the config "
                "(text_column=... in Python).")
        check_roles(tokenizer, [conversation])
        text_column = names.get("text_column", "text")
        if _filled(row.get(text_column)):
            import logging

            logging.getLogger(__name__).warning(
                "Rows hold both a conversation (%r) and text (%r): the conversation is trained on and the text is "
                "not. To train on the text, set training.messages_column: null (messages_column=None in Python).",
                column, text_column)


_SAMPLED_CONVERSATIONS = 64


def _warn_about_sampled_conversations(dataset, tokenizer, seq_len: int, column: str, text_column: str = "text"
                                      ) -> None:
    """What trains silently wrong in chat data, counted in the first conversations, rendered here on the driver:
    a conversation longer than a row is split into pieces trained apart (an answer past the cut no longer sees
    its question: right for long text, harmful for fine-tuning on chats), an assistant turn with empty content
    teaches the model to end its turn at once, and a row with no conversation (and no text) is skipped."""
    import logging

    rows = dataset.take(_SAMPLED_CONVERSATIONS)
    conversations = []
    for row in rows:
        value = row.get(column)
        value = value.tolist() if hasattr(value, "tolist") else value
        if isinstance(value, (list, tuple)) and value:
            conversations.append(list(value))
    log = logging.getLogger(__name__)
    skipped = sum(not _has_document(row, text_column=text_column, messages_column=column) for row in rows)
    if skipped:
        log.warning("%d of the first %d rows have no conversation (%r empty or null, no %r either): they are skipped, "
                    "not trained on. Is that file's chat under another key?", skipped, len(rows), column, text_column)
    if not conversations:
        return
    empty = sum(any(isinstance(m, Mapping) and m.get("role") == "assistant" and not str(m.get("content") or "").strip()
                    for m in conv) for conv in conversations)
    if empty:
        log.warning("%d of the first %d conversations have an assistant turn with empty content: the model learns to "
                    "answer their prompts by ending its turn at once. Drop those turns or fill them.",
                    empty, len(conversations))
    docs, masks = encode_chats(tokenizer, conversations)
    _warn_if_turns_are_not_marked(conversations, masks, log)
    _warn_if_turn_ends_are_not_trained(tokenizer, docs, masks, log)
    lengths = [len(doc) for doc in docs]
    long = [n for n in lengths if n > seq_len]
    if long:
        log.warning(
            "%d of the first %d conversations are longer than max_sequence_length=%d tokens (the longest %d): each is "
            "split into rows trained apart, and an answer past a cut no longer sees its question. Raise "
            "training.max_sequence_length (up to the model's max_position_embeddings), or shorten or drop the long "
            "conversations.", len(long), len(lengths), seq_len, max(long))


def _warn_if_turns_are_not_marked(conversations, masks, log) -> None:
    """A template that wraps only some assistant turns in {% generation %} (the last, say) leaves the others'
    answers out of the loss; encode_chats refuses only a conversation with no token marked at all (a review). Each
    marked turn is a run of ones in the mask, and the turn headers between runs are never marked."""
    short = 0
    for conv, mask in zip(conversations, masks):
        turns = sum(isinstance(m, Mapping) and m.get("role") == "assistant"
                    and bool(str(m.get("content") or "").strip()) for m in conv)
        runs = int((np.diff(np.concatenate([[0], mask, [0]])) == 1).sum())
        short += runs < turns
    if short:
        log.warning("In %d of the first %d conversations the chat template marks fewer spans for the loss than there "
                    "are assistant turns: its {%% generation %%} tags surround only some of them (the last turn, say), "
                    "and the other answers train nothing. If that is not meant, wrap every assistant turn's content "
                    "in the tags (see DEFAULT_CHAT_TEMPLATE).", short, len(conversations))


def _warn_if_turn_ends_are_not_trained(tokenizer, docs, masks, log) -> None:
    """A chat template whose {% endgeneration %} comes before its end-of-turn token (`<|im_end|>`, `<|eot_id|>`)
    leaves that token out of the loss: the model never learns to end its turn and generates on (a numerics
    review; the default template keeps eos inside)."""
    special = np.asarray(sorted(getattr(tokenizer, "all_special_ids", None) or []))
    untrained = {}
    for ids, mask in zip(docs, masks):
        edges = np.diff(np.concatenate([[0], mask, [0]]))
        for start, end in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)):
            # A turn that trains a special token of its own (eos, `<|im_end|>` then a newline) learns to end;
            # one that trains its content only, with a special token next, does not. Content cannot hold special
            # tokens (`_check_no_special_token_text`), so the turn's own end is the only one it can train.
            if end < len(ids) and not np.isin(ids[start:end], special).any() and np.isin(ids[end], special):
                untrained[int(ids[end])] = untrained.get(int(ids[end]), 0) + 1
    if untrained:
        token = max(untrained, key=untrained.get)
        log.warning("The chat template trains %d assistant turns of the first conversations up to their content "
                    "only: the token after each (%r) lies outside its {%% generation %%} block, so the loss never "
                    "trains the model to end its turn, and it will not stop generating. Put the turn's end token "
                    "inside the block, before {%% endgeneration %%} (as DEFAULT_CHAT_TEMPLATE does with eos).",
                    sum(untrained.values()), tokenizer.convert_ids_to_tokens(token))


def build_lm_dataset(source, tokenizer, seq_len: int, *, format: str | None = None, **kwargs):
    """``load_text_dataset(source)`` then ``tokenize_and_pack``: any source to packed LM rows."""
    return tokenize_and_pack(load_text_dataset(source, format=format), tokenizer, seq_len, **kwargs)
