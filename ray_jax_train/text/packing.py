"""Pack tokenised documents into fixed-length rows (pure numpy, no tokenizer, no Ray).

Every document is expected to end with its eos token (the encoders in ``encode.py`` append it).
Documents are placed first-fit, in input order, into rows of ``seq_len`` tokens; a row may hold
several documents, told apart by ``segment_ids`` so the model can attend block-diagonally.

Per row (all int32, length ``seq_len``):

* ``input_ids``   tokens, ``pad_id`` where unused;
* ``targets``     the next token of the same document, ``pad_id`` where there is none;
* ``loss_mask``   1 where ``targets`` is a real next token of the same document *and* that token
  is trainable (its label mask is 1); so the last token of a document never learns to predict
  the first token of the next one, and padding is 0;
* ``segment_ids`` 1, 2, 3, ... per document piece within the row, 0 on padding;
* ``positions``   the token's offset inside its document.

Long documents: a document longer than ``seq_len`` is split into consecutive full rows of
``seq_len`` tokens plus a remainder that is packed like any short document. Positions *continue*
across the pieces (a piece starting at token 2048 of its document starts at position 2048),
so a token always carries its true position; with rotary embeddings this is the same as
restarting, and with learned embeddings it keeps every position in the table's range as long
as the document fits it. The last token of a piece still predicts the first token of the next
piece (it is the same document), so splitting loses no training signal; only attention across
the cut is lost. Because positions continue, a document longer than ``max_position_embeddings``
cannot be represented: with ``truncation=True`` it is split into documents of that length (each
starts again at position 0; only the prediction across each cut is lost, never the tokens), with
``truncation=False`` it raises ``SequenceTooLongError``. Documents with fewer than two tokens are
dropped: they hold no next-token prediction.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .errors import SequenceTooLongError

PACKED_KEYS = ("input_ids", "targets", "loss_mask", "segment_ids", "positions")


def limit_document(tokens: np.ndarray, label_mask: np.ndarray, *, index: int,
                   max_position_embeddings: int | None, truncation: bool):
    """Apply the position-table limit to one document: a list of (tokens, label mask) documents that fit it.

    With truncation a long document is split, not cut: cutting dropped most of the text of long files (69% of
    the quick start's stdlib docstring tokens at 2048).
    """
    if max_position_embeddings is None or len(tokens) <= max_position_embeddings:
        return [(tokens, label_mask)]
    if truncation:
        step = max_position_embeddings
        return [(tokens[a:a + step], label_mask[a:a + step]) for a in range(0, len(tokens), step)]
    raise SequenceTooLongError(
        f"document {index} has {len(tokens)} tokens, more than max_position_embeddings="
        f"{max_position_embeddings}, and truncation is off. Positions continue across packed rows, "
        f"so the model cannot represent it. Pass truncation=True to split long documents into documents of "
        f"{max_position_embeddings} tokens, or filter them out before tokenising.")


def _place(rows_fill: list[int], open_rows: list[int], n: int, seq_len: int) -> int:
    """First-fit: the first open row with room for ``n`` tokens, else a new row."""
    for k, row in enumerate(open_rows):
        if seq_len - rows_fill[row] >= n:
            if rows_fill[row] + n == seq_len:
                del open_rows[k]
            return row
    rows_fill.append(0)
    row = len(rows_fill) - 1
    if n < seq_len:
        open_rows.append(row)
    return row


def _token_ids(doc, i: int) -> np.ndarray:
    """Document ``i`` as int64 ids, refused where a cast would change them: floats were truncated (5.7 -> 5), ids
    past int32 wrapped negative in the int32 rows, and a 2-D document was flattened into one (a review)."""
    tokens = np.asarray(doc)
    if tokens.ndim != 1:
        raise ValueError(f"document {i}: token ids must be a flat sequence, got an array of shape {tokens.shape}")
    if tokens.size and tokens.dtype.kind not in "iu":
        raise ValueError(f"document {i}: token ids must be integers, got {tokens.dtype} (e.g. {tokens[0]!r})")
    tokens = tokens.astype(np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max):
        bad = tokens[(tokens < 0) | (tokens > np.iinfo(np.int32).max)][0]
        raise ValueError(f"document {i}: token id {bad} is outside 0..{np.iinfo(np.int32).max}")
    return tokens


def _label_mask(mask, i: int, n: int) -> np.ndarray:
    """Document ``i``'s label mask as 0/1: the loss weighs tokens by it, so Hugging Face's labels (-100 for no
    target) passed here summed to a negative loss over a negative token count (a review)."""
    mask = np.asarray(mask)
    if mask.ndim != 1 or len(mask) != n:
        raise ValueError(f"document {i}: label mask has {mask.size} entries in shape {mask.shape} for {n} tokens")
    if mask.size and not np.isin(mask, (0, 1)).all():
        raise ValueError(f"document {i}: label mask values must be 0 or 1 (1: the token is a training target), got "
                         f"{sorted(set(np.unique(mask).tolist()) - {0, 1})[:5]}; for Hugging Face labels pass "
                         "(labels != -100)")
    return mask.astype(np.int32)


def pack_documents(documents: Sequence[Sequence[int]], seq_len: int, *,
                   label_masks: Sequence[Sequence[int]] | None = None, pad_id: int = 0,
                   max_position_embeddings: int | None = None,
                   truncation: bool = False) -> dict[str, np.ndarray]:
    """Pack ``documents`` (token id sequences, each ending with eos) into ``(rows, seq_len)`` arrays.

    ``label_masks[i][t]`` says whether token ``t`` of document ``i`` may be a training target
    (chat data: assistant tokens only); omitted means every token is. Returns a dict with the
    keys in ``PACKED_KEYS``; with no usable document the arrays have zero rows.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    if label_masks is not None and len(label_masks) != len(documents):
        raise ValueError(f"got {len(label_masks)} label masks for {len(documents)} documents")

    pieces = []  # (row, start_in_row, doc, label_mask, a, b): doc[a:b] goes to row[start:start+b-a]
    rows_fill: list[int] = []
    open_rows: list[int] = []
    for i, doc in enumerate(documents):
        tokens = _token_ids(doc, i)
        if label_masks is None:
            mask = np.ones(len(tokens), dtype=np.int32)
        else:
            mask = _label_mask(label_masks[i], i, len(tokens))
        for tokens, mask in limit_document(tokens, mask, index=i, truncation=truncation,
                                           max_position_embeddings=max_position_embeddings):
            if len(tokens) < 2:
                continue
            a = 0
            while len(tokens) - a > seq_len:  # full rows first, so only the remainder competes for space
                row = _place(rows_fill, open_rows, seq_len, seq_len)
                pieces.append((row, 0, tokens, mask, a, a + seq_len))
                rows_fill[row] = seq_len
                a += seq_len
            n = len(tokens) - a
            row = _place(rows_fill, open_rows, n, seq_len)
            pieces.append((row, rows_fill[row], tokens, mask, a, len(tokens)))
            rows_fill[row] += n

    n_rows = len(rows_fill)
    out = {k: np.zeros((n_rows, seq_len), dtype=np.int32) for k in PACKED_KEYS}
    out["input_ids"][:] = pad_id
    out["targets"][:] = pad_id
    next_segment = np.ones(n_rows, dtype=np.int32)
    for row, s, tokens, mask, a, b in pieces:
        n = b - a
        e = s + n
        out["input_ids"][row, s:e] = tokens[a:b]
        # The target of token t is token t+1 of the same document; the document's own last
        # token has none, so it gets pad_id and no loss (never the next document's first token).
        has_next = min(b + 1, len(tokens)) - (a + 1)
        out["targets"][row, s:s + has_next] = tokens[a + 1:a + 1 + has_next]
        out["loss_mask"][row, s:s + has_next] = mask[a + 1:a + 1 + has_next]
        out["segment_ids"][row, s:e] = next_segment[row]
        next_segment[row] += 1
        out["positions"][row, s:e] = np.arange(a, b, dtype=np.int32)
    return out
