"""Text pipeline: local tokenizers, offline corpus, sources, Ray Data tokenisation and packing.

Packed rows (all int32, length seq_len): input_ids, targets, loss_mask, segment_ids, positions;
see ``packing.py`` for the exact rules.
"""
from .corpus import local_corpus
from .encode import encode_chats, encode_texts
from .errors import (EmptyDatasetError, MissingColumnError, NoChatTemplateError, SequenceTooLongError,
                     TextDataError)
from .packing import PACKED_KEYS, pack_documents
from .pipeline import TokenizeAndPack, build_lm_dataset, tokenize_and_pack
from .samples import process_messages_data, process_sample_data
from .sources import extract_column_names, load_text_dataset
from .tokenizer import (DEFAULT_CHAT_TEMPLATE, check_chat_template, ensure_pad_token, load_tokenizer,
                        train_tokenizer)

__all__ = [
    "DEFAULT_CHAT_TEMPLATE", "PACKED_KEYS", "EmptyDatasetError", "MissingColumnError", "NoChatTemplateError",
    "SequenceTooLongError", "TextDataError", "TokenizeAndPack", "build_lm_dataset", "check_chat_template",
    "encode_chats", "encode_texts", "ensure_pad_token", "extract_column_names", "load_text_dataset",
    "load_tokenizer", "local_corpus", "pack_documents", "process_messages_data", "process_sample_data",
    "tokenize_and_pack", "train_tokenizer",
]
