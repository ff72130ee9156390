"""Sampling from a causal LM: one compiled program runs the prompt through a KV cache, then a fixed-shape loop adds
one token a step (greedy, or sampled with temperature, top-k and top-p), so no token triggers a recompile.

    ids = generate(model, input_ids, attention_mask, max_new_tokens=32, eos_token_id=tok.eos_token_id)
    text = generate_text(model, tok, [{"role": "user", "content": "Hi"}], max_new_tokens=32)
"""
from __future__ import annotations

import math
import os
import numbers
from functools import partial
from typing import Any, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ray_jax_train.models.llama import KVCache, LlamaForCausalLM

__all__ = ["generate", "generate_text"]

_FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal: XLA flushes smaller numbers to 0
DEFAULT_NEW_TOKENS = 64

Conversation = Sequence[Mapping[str, Any]]
Prompt = Union[str, Conversation]


def generate(model: LlamaForCausalLM, input_ids, attention_mask=None, *, max_new_tokens: int,
             temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
             eos_token_id: Union[int, Sequence[int], None] = None, pad_token_id: Optional[int] = None,
             seed: int = 0) -> jax.Array:
    """New token ids ``[batch, max_new_tokens]`` continuing left-padded prompts ``input_ids`` ``[batch, seq]``.

    ``temperature=0`` is greedy; otherwise tokens are sampled (``top_k``, ``top_p`` narrow the choice), reproducibly
    for a given ``seed``. A row stops after its first ``eos_token_id`` (one id or several; kept in the output) and
    holds ``pad_token_id`` (default: the config's, else the first eos id, else 0) from there on.
    ``eos_token_id`` defaults to the model config's (transformers' ``generate`` takes it from the generation
    config, which starts from the model config's; ``generation_eos_ids(dir)`` reads a generation_config.json's); ``[]``
    never stops early.
    """
    config = model.config
    ids, mask = _check_prompts(config, input_ids, attention_mask, max_new_tokens)
    _check_sampling(temperature, top_k, top_p, seed)
    eos = _token_ids(config.eos_token_id if eos_token_id is None else eos_token_id, "eos_token_id")
    if pad_token_id is None:
        pad_token_id = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    # A temperature float32 cannot tell from 0 would divide the logits by zero: it is greedy anyway.
    greedy = float(temperature) < _FLOAT32_TINY
    return _generate(model, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(seed),
                     jnp.float32(1.0 if greedy else temperature), jnp.float32(1.0 if top_p is None else top_p), jnp.asarray(eos, jnp.int32),
                     jnp.int32(pad_token_id), max_new_tokens=max_new_tokens, greedy=greedy,
                     top_k=None if greedy or top_k is None else min(top_k, config.vocab_size),
                     nucleus=not greedy and top_p is not None and top_p < 1)


def generate_text(model: LlamaForCausalLM, tokenizer, prompts: Union[Prompt, Sequence[Prompt]], *,
                  max_new_tokens: Optional[int] = None, temperature: float = 0.0, top_k: Optional[int] = None,
                  top_p: Optional[float] = None, seed: int = 0,
                  eos_token_id: Union[int, Sequence[int], None] = None) -> Union[str, list[str]]:
    """Complete text prompts, or answer conversations (lists of ``{"role", "content"}`` messages).

    A text prompt is encoded as in training, ``[bos] + tokens``; a conversation goes through the tokenizer's chat
    template with its generation prompt (the assistant header). Completions end at the tokenizer's or the model's
    eos, and at any of ``eos_token_id`` (e.g. ``generation_eos_ids(model_dir)``), and are decoded without special
    tokens. One prompt gives one string, a list of prompts a list.
    ``max_new_tokens`` defaults to 64, or fewer where the longest prompt leaves less room in
    ``max_position_embeddings`` (a small model trained on short rows has little).
    """
    if isinstance(prompts, Mapping):  # its keys were completed as two text prompts (a Python API review)
        raise ValueError("generate_text got one message (a dict); a conversation is a list of them: "
                         "[{'role': 'user', 'content': ...}]")
    if isinstance(tokenizer, (str, os.PathLike)):  # a tokenizer directory, as the CLI's --tokenizer takes
        from ray_jax_train.text import load_tokenizer

        tokenizer = load_tokenizer(tokenizer)
    single = isinstance(prompts, str) or _is_conversation(prompts)
    batch = [prompts] if single else list(prompts)
    if not batch:
        raise ValueError("generate_text got no prompts")
    encoded = [_encode(tokenizer, p) for p in batch]
    if max_new_tokens is None:
        room = model.config.max_position_embeddings - max(len(e) for e in encoded)
        max_new_tokens = min(DEFAULT_NEW_TOKENS, room) if room > 0 else DEFAULT_NEW_TOKENS  # none: the check says so
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # Lengths rounded up to a multiple of 16 so that prompts of similar lengths share one compiled program.
    width = 16 * math.ceil(max(len(e) for e in encoded) / 16)
    ids = np.full((len(batch), width), pad, np.int32)
    mask = np.zeros((len(batch), width), np.int32)
    for row, e in enumerate(encoded):
        if len(e):
            ids[row, -len(e):], mask[row, -len(e):] = e, 1
    eos = set(_token_ids(tokenizer.eos_token_id, "eos_token_id"))
    # An instruct checkpoint's config may name the end-of-turn token that a chat answer ends with.
    eos.update(_token_ids(model.config.eos_token_id, "eos_token_id"))
    eos.update(_token_ids(eos_token_id, "eos_token_id"))
    out = np.asarray(generate(model, ids, mask, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                              top_p=top_p, eos_token_id=sorted(eos), pad_token_id=pad, seed=seed))
    texts = []
    for row in out.tolist():
        stop = next((i for i, t in enumerate(row) if t in eos), len(row))
        texts.append(tokenizer.decode(row[:stop], skip_special_tokens=True))
    return texts[0] if single else texts


def _is_conversation(prompt: Any) -> bool:
    return not isinstance(prompt, str) and isinstance(prompt, Sequence) and len(prompt) > 0 \
        and isinstance(prompt[0], Mapping)


def _encode(tokenizer, prompt: Prompt) -> list[int]:
    from ray_jax_train.text import NoChatTemplateError, encode_texts

    if isinstance(prompt, str):
        return [int(t) for t in encode_texts(tokenizer, [prompt], add_bos=True)[0][:-1]]  # without the closing eos
    if not _is_conversation(prompt):
        raise ValueError(f"a prompt must be a string or a conversation (a list of {{'role', 'content'}} dicts), "
                         f"got {type(prompt).__name__}: {str(prompt)[:80]!r}")
    # Only a template is needed here, not the {% generation %} tags that training on chats asks for.
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplateError("the tokenizer has no chat template, so it cannot render a conversation; give "
                                  "text prompts, or give the tokenizer one (in Python: set its chat_template "
                                  "attribute, e.g. to ray_jax_train.text.DEFAULT_CHAT_TEMPLATE, and save_pretrained "
                                  "it into the model directory)")
    for i, message in enumerate(prompt):  # the template's own error ("'dict object' has no attribute") named neither
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"message {i} of the conversation needs a string 'role' and 'content', got "
                             f"{str(message)[:80]!r}")
    return list(tokenizer.apply_chat_template([dict(m) for m in prompt], tokenize=True, return_dict=True,
                                              add_generation_prompt=True)["input_ids"])


def _token_ids(value: Union[int, Sequence[int], None], name: str) -> list[int]:
    if value is None:
        return []
    values = [value] if isinstance(value, (int, np.integer)) else list(value)
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{name} must be a token id or a list of them, got {value!r}")
    return [int(v) for v in values]


def _check_prompts(config, input_ids, attention_mask, max_new_tokens):
    """The prompts as int32 numpy arrays, after the checks that would otherwise fail inside the compiled program
    or, worse, not fail at all."""
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or ids.shape[1] == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must be integer token ids [batch, prompt_length] with at least one column, "
                         f"got shape {ids.shape} and dtype {ids.dtype}")
    mask = np.ones(ids.shape, np.int32) if attention_mask is None else np.asarray(attention_mask)
    if mask.shape != ids.shape or not np.isin(mask, (0, 1)).all():
        raise ValueError(f"attention_mask must be 0/1 of the shape of input_ids {ids.shape}, got shape {mask.shape}")
    mask = mask.astype(np.int32)
    if (np.diff(mask, axis=1) < 0).any():
        raise ValueError("prompts must be left-padded (attention_mask 0...0 1...1 in every row): the new tokens "
                         "follow the last column")
    lengths = mask.sum(axis=1)
    if (lengths == 0).any():
        raise ValueError(f"rows {np.flatnonzero(lengths == 0).tolist()} have an empty prompt; every prompt needs at "
                         "least one token (e.g. the bos token)")
    real = ids[mask == 1]
    if real.min() < 0 or real.max() >= config.vocab_size:
        raise ValueError(f"input_ids holds token ids outside [0, vocab_size={config.vocab_size}): "
                         f"{int(real.min())}..{int(real.max())}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if lengths.max() + max_new_tokens > config.max_position_embeddings:
        raise ValueError(f"the longest prompt ({int(lengths.max())} tokens) plus max_new_tokens={max_new_tokens} "
                         f"exceeds the model's max_position_embeddings={config.max_position_embeddings}; shorten "
                         "the prompt or ask for fewer tokens")
    # Padding ids are never attended to, but an out-of-range one would gather NaNs into the cache (0 * NaN = NaN).
    return np.where(mask == 1, ids, 0).astype(np.int32), mask


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_sampling(temperature, top_k, top_p, seed=0) -> None:
    if not (_real(temperature) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not (_real(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    if temperature == 0 and (top_k is not None or (top_p is not None and top_p < 1)):
        # Greedy decoding ignored them without a word (a Python API review).
        given = ", ".join(f"{k}={v}" for k, v in (("top_k", top_k), ("top_p", top_p)) if v is not None)
        raise ValueError(f"{given} narrows sampling, and temperature=0 decodes greedily; set temperature > 0 (e.g. "
                         "0.8) to sample, or leave them out")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")


@partial(nnx.jit, static_argnames=("max_new_tokens", "greedy", "top_k", "nucleus"))
def _generate(model, ids, mask, key, temperature, top_p, eos, pad, *, max_new_tokens, greedy, top_k, nucleus):
    b, s = ids.shape
    # The last new token is returned, never fed back: it needs no slot.
    cache = KVCache.create(model.config, b, s + max_new_tokens - 1)
    logits, cache = model.decode(ids, cache, attention_mask=mask)

    def pick(logits, step):
        if greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return _sample(logits, jax.random.fold_in(key, step), temperature, top_k, top_p if nucleus else None)

    def is_eos(tokens):
        return jnp.any(tokens[:, None] == eos[None, :], axis=-1)

    def running(carry):
        step, _, done, _, _ = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def step_fn(carry):
        step, token, done, out, cache = carry
        logits, cache = model.decode(token[:, None], cache)
        token = jnp.where(done, pad, pick(logits, step))
        out = jax.lax.dynamic_update_slice_in_dim(out, token[:, None], step, axis=1)
        return step + 1, token, done | is_eos(token), out, cache

    first = pick(logits, 0)
    out = jnp.full((b, max_new_tokens), pad, jnp.int32).at[:, 0].set(first)
    carry = (jnp.int32(1), first, is_eos(first), out, cache)
    return jax.lax.while_loop(running, step_fn, carry)[3]


def _sample(logits, key, temperature, top_k, top_p):
    """One token per row from ``softmax(logits / temperature)``, cut to the ``top_k`` best, then to the fewest
    best tokens whose probability reaches ``top_p`` (the order transformers applies them in)."""
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        ranked = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ranked, axis=-1)
        keep = jnp.cumsum(probs, axis=-1) - probs < top_p  # the best token always stays
        cutoff = jnp.min(jnp.where(keep, ranked, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
