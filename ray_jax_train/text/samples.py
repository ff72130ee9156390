"""Single-sample helpers in the EasyDeL style: one text or conversation -> fixed-length arrays.

Used for prompts and previews outside Ray Data (e.g. a trainer's generation step). Arrays are
1-D ``int32`` of length ``max_length``: JAX wants static shapes, so we always pad.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .encode import encode_chats, encode_texts
from .errors import MissingColumnError, SequenceTooLongError
from .tokenizer import check_chat_template, ensure_pad_token


def _pad(tokenizer, ids: Sequence[int], max_length: int, padding_side: str, truncation: bool,
         truncation_side: str | None) -> dict[str, np.ndarray]:
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    ids = list(ids)
    if len(ids) > max_length:
        if not truncation:
            raise SequenceTooLongError(f"the sample has {len(ids)} tokens, more than max_length={max_length}, "
                                       f"and truncation is off; pass truncation=True or a larger max_length")
        # Left padding is for prompts that get continued, so by default keep their end.
        side = truncation_side or padding_side
        ids = ids[-max_length:] if side == "left" else ids[:max_length]
    pad_id = ensure_pad_token(tokenizer).pad_token_id
    n_pad = max_length - len(ids)
    input_ids = np.full(max_length, pad_id, dtype=np.int32)
    attention_mask = np.zeros(max_length, dtype=np.int32)
    sl = slice(n_pad, max_length) if padding_side == "left" else slice(0, len(ids))
    input_ids[sl] = ids
    attention_mask[sl] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def process_messages_data(tokenizer, messages: Sequence[Mapping[str, Any]], max_length: int,
                          padding_side: str = "left", *, add_generation_prompt: bool = False,
                          truncation: bool = True, truncation_side: str | None = None) -> dict[str, np.ndarray]:
    """Render one conversation with the chat template and pad it to ``max_length``.

    ``add_generation_prompt=True`` ends it with the assistant header, for prompting a model.
    Truncation keeps the end when ``truncation_side`` (default: ``padding_side``) is "left".
    """
    # A prompt needs only the template; the loss mask's {% generation %} tags matter for training data alone.
    check_chat_template(tokenizer, assistant_mask=not add_generation_prompt)
    if add_generation_prompt:
        ids = tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=True, return_dict=True,
                                            add_generation_prompt=True)["input_ids"]
    else:
        ids = encode_chats(tokenizer, [messages])[0][0]
    return _pad(tokenizer, ids, max_length, padding_side, truncation, truncation_side)


def process_sample_data(tokenizer, sample: str | Mapping[str, Any], max_length: int,
                        padding_side: str = "left", *, text_column: str = "text",
                        messages_column: str = "messages", add_bos: bool = True, add_eos: bool = True,
                        truncation: bool = True, truncation_side: str | None = None) -> dict[str, np.ndarray]:
    """Tokenize one sample (a string, or a row with a text or messages column) to padded arrays.

    Text is laid out as in the packed pipeline ([bos] + tokens + eos); a row with a messages
    column goes through ``process_messages_data``.
    """
    if isinstance(sample, Mapping):
        # As the packed pipeline reads a file mixing text and chat rows: a row with no conversation (null or
        # empty) is text.
        conversation = sample.get(messages_column)
        if conversation is not None and not isinstance(conversation, float) and len(conversation):
            return process_messages_data(tokenizer, conversation, max_length, padding_side,
                                         truncation=truncation, truncation_side=truncation_side)
        if text_column not in sample:
            empty = f"an empty messages column {messages_column!r}" if messages_column in sample else \
                f"no messages column {messages_column!r}"
            raise MissingColumnError(f"the sample has no text column {text_column!r} and {empty}; its keys are "
                                     f"{list(sample)}")
        sample = sample[text_column]
    ids = list(encode_texts(tokenizer, [sample], add_bos=add_bos)[0])
    if not add_eos:
        ids = ids[:-1]
    return _pad(tokenizer, ids, max_length, padding_side, truncation, truncation_side)
