"""Train, load and check tokenizers locally: nothing here touches the Hugging Face Hub."""
from __future__ import annotations

import json
import logging
import numbers
import os
import re
from typing import Iterable

from .errors import NoChatTemplateError
from .._imports import uninterrupted_imports

logger = logging.getLogger(__name__)

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")

# Every turn is "<|role|>" + content + eos. Assistant content and its closing eos sit inside
# {% generation %} so apply_chat_template(return_assistant_tokens_mask=True) marks exactly the
# tokens the model should learn to produce, including when to stop; the role header is prompt.
# The header is the special token alone: a "\n" after it would BPE-merge with content that starts
# with a newline, so training would see a token the generation prompt never ends with.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, *, min_frequency: int = 2,
                    chat_template: str | None = DEFAULT_CHAT_TEMPLATE,
                    model_max_length: int | None = None, save_dir: str | os.PathLike | None = None):
    """Train a byte-level BPE on ``texts`` and wrap it as a ``PreTrainedTokenizerFast``.

    Byte-level means every string is encodable (no unknown token), so a tiny local corpus is
    enough for a working tokenizer. The result has bos/eos/pad tokens, the role tokens of
    ``DEFAULT_CHAT_TEMPLATE`` and that template; it adds no special tokens on plain ``__call__``
    because the data pipeline decides where bos/eos go. ``vocab_size`` is an upper bound: a
    small corpus may yield fewer merges. With ``save_dir`` it is also saved there, ready for
    ``AutoTokenizer.from_pretrained(save_dir)`` offline.
    """
    with uninterrupted_imports():  # a Ray Data worker's import, cut by a cancel, must not leave it half-made
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

    special = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS]
    # Wrong input gave a byte-only tokenizer of 262 tokens without a word, or failed inside the tokenizers library
    # naming neither the argument nor the fix (a Python API review).
    if isinstance(texts, (str, bytes)):
        raise TypeError("train_tokenizer takes an iterable of texts, not one string (it would learn from its "
                        "characters); pass [text]")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):
        raise TypeError(f"vocab_size must be an integer, got {vocab_size!r}")
    vocab_size = int(vocab_size)
    if save_dir is not None and os.path.isfile(os.fspath(save_dir)):
        raise ValueError(f"save_dir {os.fspath(save_dir)!r} is a file; give a directory to save the tokenizer in")
    if vocab_size < len(special) + 256:
        raise ValueError(f"vocab_size={vocab_size} is too small: byte-level BPE needs 256 byte tokens "
                         f"plus {len(special)} special tokens")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    counted = [0]

    def checked():
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"train_tokenizer: text {i} is a {type(text).__name__}, not a str (rows of a dataset: "
                                "pass [row['text'] for row in rows])")
            counted[0] += 1
            yield text

    backend.train_from_iterator(checked(), trainer)
    if not counted[0]:
        raise ValueError("train_tokenizer got no texts to learn from")
    kwargs = {} if model_max_length is None else {"model_max_length": model_max_length}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS), chat_template=chat_template, **kwargs)
    if save_dir is not None:
        tokenizer.save_pretrained(os.fspath(save_dir))
    return tokenizer


def load_tokenizer(tokenizer_or_path):
    """Return a tokenizer: the object itself, or one loaded from a local directory or a storage URI (never the Hub)."""
    if isinstance(tokenizer_or_path, (str, os.PathLike)):
        path = os.fspath(tokenizer_or_path)
        if "://" in path:
            return _load_from_uri(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"tokenizer directory {path!r} does not exist; save one with "
                                    f"tokenizer.save_pretrained(dir) or train_tokenizer(..., save_dir=dir)")
        with uninterrupted_imports():  # a Ray Data worker's import, cut by a cancel, must not leave it half-made
            if _plain_tokenizers_backend(path):
                from transformers import PreTrainedTokenizerFast as tokenizer_class
            else:
                from transformers import AutoTokenizer as tokenizer_class

        try:
            return tokenizer_class.from_pretrained(path, local_files_only=True)
        except ImportError:  # a missing package (sentencepiece): its own message says which
            raise
        except Exception as exc:  # transformers' own errors name neither the directory nor the fix
            files = [n for n in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
                     if os.path.isfile(os.path.join(path, n))]
            if not files:
                raise ValueError(f"{path!r} holds no tokenizer (no tokenizer.json or tokenizer_config.json); save one "
                                 "with tokenizer.save_pretrained(dir) or train_tokenizer(..., save_dir=dir)") from None
            raise ValueError(f"the tokenizer in {path!r} could not be read ({type(exc).__name__}: {exc}); a file of it "
                             f"({', '.join(files)}) is damaged or cut short: put back a good copy (a run's checkpoints "
                             "need the very tokenizer they were trained with), or name another") from exc
    return tokenizer_or_path


# Classes that are the `tokenizers` library's tokenizer under transformers' API with nothing of their own: every
# tokenizer train_tokenizer saves, and many a model's. (PreTrainedTokenizerFast is TokenizersBackend in
# transformers 5.)
_TOKENIZERS_BACKEND_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _plain_tokenizers_backend(path: str) -> bool:
    """Whether the tokenizer saved in `path` loads as transformers' plain fast tokenizer, with no class to look up.

    AutoTokenizer's lookup imports transformers' model configurations, and with them torch where it is installed:
    2.4 s of a CPU where loading the class itself takes 0.9 s, in every process that loads a tokenizer (the
    driver, each Tune trial, Ray Data's tokenising workers)."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False  # AutoTokenizer's lookup then, and its error where there is one
    return (isinstance(config, dict) and config.get("tokenizer_class") in _TOKENIZERS_BACKEND_CLASSES
            and "auto_map" not in config and os.path.isfile(os.path.join(path, "tokenizer.json")))


def _load_from_uri(uri: str):
    """A tokenizer saved in run storage (gs://, s3://): copied to a temporary directory, then loaded."""
    import tempfile

    import pyarrow.fs as pafs

    fs, path = pafs.FileSystem.from_uri(uri)
    if fs.get_file_info(path).type != pafs.FileType.Directory:
        raise FileNotFoundError(f"tokenizer directory {uri!r} does not exist")
    with tempfile.TemporaryDirectory(prefix="rjt_tokenizer_") as local:
        pafs.copy_files(path, local, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        return load_tokenizer(local)


def ensure_pad_token(tokenizer):
    """Give ``tokenizer`` a pad token, falling back to eos (with a warning); returns it.

    Padding positions never carry loss, so reusing eos is harmless, but it is worth a warning
    because it makes ``input_ids == pad_id`` useless for finding padding.
    """
    if tokenizer.pad_token_id is not None:
        return tokenizer
    if tokenizer.eos_token is None:
        raise ValueError("tokenizer has neither a pad token nor an eos token to pad with; "
                         "set tokenizer.pad_token before building batches")
    logger.warning("tokenizer has no pad token; padding with the eos token %r", tokenizer.eos_token)
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def check_chat_template(tokenizer, *, assistant_mask: bool = True) -> None:
    """Raise ``NoChatTemplateError`` unless the tokenizer can render messages, with an assistant mask unless
    ``assistant_mask=False`` (a prompt to continue needs none)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise NoChatTemplateError(
            "the data has a messages column but the tokenizer has no chat template. Give it one in Python: "
            "load it (transformers.AutoTokenizer.from_pretrained(dir)), set its chat_template attribute, e.g. to "
            "ray_jax_train.text.DEFAULT_CHAT_TEMPLATE (and add that template's role tokens), and save_pretrained(dir) "
            "(the CLI's tokenizer.path then reads it); or train one with ray_jax_train.text.train_tokenizer (the "
            "CLI does when tokenizer.path is not set); or give a text column instead.")
    if not assistant_mask:
        return
    templates = template.values() if isinstance(template, dict) else [template]
    # The tag itself, not the word: nearly every chat template mentions `add_generation_prompt`.
    if not any(_GENERATION_TAG.search(t) for t in templates):
        raise NoChatTemplateError(
            "the tokenizer's chat template does not mark assistant turns with "
            "{% generation %}...{% endgeneration %}, so there is no way to put the loss on assistant "
            "tokens only. Wrap assistant content in those tags (see DEFAULT_CHAT_TEMPLATE).")
