"""Turn raw text or chat conversations into token documents ready for ``pack_documents``.

Pure functions of (tokenizer, batch of values): Ray Data workers and the single-sample helpers
share them, so both paths tokenize identically.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import jinja2
import numpy as np

from .errors import NoChatTemplateError, TextDataError
from .tokenizer import check_chat_template


def _eos_id(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; documents must end with one so packed rows "
                         "show where each ends. Set tokenizer.eos_token.")
    return int(tokenizer.eos_token_id)


def encode_texts(tokenizer, texts: Sequence[str | None], *, add_bos: bool = True) -> list[np.ndarray]:
    """Tokenize each text as one document: [bos] + tokens + eos (None counts as empty)."""
    eos = _eos_id(tokenizer)
    bos = [int(tokenizer.bos_token_id)] if add_bos and tokenizer.bos_token_id is not None else []
    if not texts:  # fast tokenizers raise IndexError on an empty batch (a Ray Data block of empty rows)
        return []
    # Special tokens are placed here, not by the tokenizer's post-processor, so every tokenizer
    # gives the same layout whatever its own defaults are. Their text inside a document ("<|eos|>" in a file
    # about tokenizers) is text: read as the real token, it ended the document mid-row with no boundary.
    ids = tokenizer([t or "" for t in texts], add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return [np.asarray(bos + list(x) + [eos], dtype=np.int64) for x in ids]


def _clean_message(message: Mapping[str, Any]) -> dict:
    # Arrow unifies struct fields across rows, filling absent keys with None; templates test for
    # presence (e.g. message.get('name')), so drop them again.
    return {k: v for k, v in dict(message).items() if v is not None}


def _special_token_texts(tokenizer) -> list[str]:
    texts = set(tokenizer.all_special_tokens)
    texts.update(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special)
    return sorted((t for t in texts if t), key=len, reverse=True)


def _check_no_special_token_text(tokenizer, conversations) -> None:
    """The chat template's output is tokenised as a whole, so "<|eos|>" written inside a message would become the
    real token: an early stop trained into an answer, or a turn forged from user text. The text path keeps such
    text literal; here the template's own tokens cannot be told from the content's, so the data is refused."""
    pattern = re.compile("|".join(re.escape(t) for t in _special_token_texts(tokenizer)) or r"(?!)")
    for conv in conversations:
        for i, message in enumerate(conv):
            content = message.get("content")
            found = pattern.search(content) if isinstance(content, str) else None
            if found:
                raise TextDataError(
                    f"message {i} (role {message.get('role')!r}) of a conversation contains the text "
                    f"{found.group()!r}, a special token of the tokenizer; the chat template would read it as the "
                    f"real token, not as text. Remove or rewrite it in the data, or drop such rows (e.g. "
                    f"dataset.filter) before training. Content: {content[:120]!r}")


# Roles every chat template is expected to know, whether or not its source spells them out (Llama 3's prints
# message['role'] between header tokens).
STANDARD_ROLES = ("system", "user", "assistant", "tool", "developer", "function", "ipython")


def check_roles(tokenizer, conversations) -> None:
    """Refuse a role the chat template cannot know. Templates print an unknown role as text or skip its turn:
    ShareGPT's "human"/"gpt" trained as literal prompt text, and a "gpt" answer got no loss token, silently."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else str(tokenizer.chat_template)
    specials = set(_special_token_texts(tokenizer))
    for conv in conversations:
        for i, message in enumerate(conv):
            role = message.get("role") if isinstance(message, Mapping) else None
            if not isinstance(role, str):
                raise TextDataError(f"message {i} of a conversation has no string 'role' ({message!r:.120}): each "
                                    "message needs a role ('system', 'user' or 'assistant') and a 'content'.")
            if role in STANDARD_ROLES or f"<|{role}|>" in specials or repr(role) in template \
                    or f'"{role}"' in template:
                continue
            hint = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant",
                    **{r: r for r in STANDARD_ROLES}}.get(role.lower())
            raise TextDataError(
                f"message {i} of a conversation has role {role!r}, which the chat template does not know: it would be "
                f"rendered as plain text (or its turn dropped), and "
                f"{'its answers get no loss' if hint == 'assistant' else 'the model learns from mislabelled turns'}. "
                f"Map the roles to {', '.join(repr(r) for r in STANDARD_ROLES[:3])}"
                f"{f' ({role!r} -> {hint!r})' if hint else ''} before training, e.g. with dataset.map.")


def _unusual_content(conversations) -> str:
    """What to fix where a template failed: the first message whose content is not a string, its usual cause."""
    for conv in conversations:
        for i, message in enumerate(conv):
            content = message.get("content")
            if content is not None and not isinstance(content, str):
                parts = (" (content parts, as OpenAI lays them out: join their text into one string)"
                         if isinstance(content, (list, tuple)) else "")
                return (f"Message {i} (role {message.get('role')!r}) has a {type(content).__name__} as its content "
                        f"({content!r:.80}){parts}; the default template reads a string 'content'.")
    return ("Check that every message has the fields the template reads (the default one reads 'role' and a string "
            "'content').")


def encode_chats(tokenizer, conversations: Sequence[Sequence[Mapping[str, Any]]],
                 ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Render each conversation with the chat template; label mask = the assistant-token mask.

    Returns (documents, label_masks). A document is closed with eos if the template did not end
    it with one; that eos is not a training target.
    """
    check_chat_template(tokenizer)
    eos = _eos_id(tokenizer)
    docs, masks = [], []
    if not conversations:
        return docs, masks
    if isinstance(conversations[0], Mapping) and "role" in conversations[0]:
        raise TextDataError("encode_chats takes a list of conversations, each a list of messages; it got one "
                            "conversation (its first item is a message): wrap it in a list.")
    convs = [[_clean_message(m) for m in conv] for conv in conversations]
    check_roles(tokenizer, convs)
    _check_no_special_token_text(tokenizer, convs)
    try:
        out = tokenizer.apply_chat_template(convs, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    except (jinja2.TemplateError, TypeError, ValueError) as exc:  # e.g. a tool call with no content, content parts
        raise TextDataError(f"the chat template could not render a conversation of this batch "
                            f"({type(exc).__name__}: {exc}). {_unusual_content(convs)}") from exc
    for conv, ids, mask in zip(convs, out["input_ids"], out["assistant_masks"]):
        ids = np.asarray(ids, dtype=np.int64)
        mask = np.asarray(mask, dtype=np.int32)
        if not mask.any() and any(m.get("role") == "assistant" and m.get("content") for m in conv):
            raise NoChatTemplateError(
                "the chat template marked none of an assistant turn's tokens for the loss (its {% generation %} "
                "tags do not surround the assistant content), so training would learn nothing from this data. "
                "Wrap the assistant content in {% generation %}...{% endgeneration %} (see DEFAULT_CHAT_TEMPLATE).")
        if len(ids) == 0 or ids[-1] != eos:
            ids = np.append(ids, eos)
            mask = np.append(mask, 0)
        docs.append(ids)
        masks.append(mask)
    return docs, masks
