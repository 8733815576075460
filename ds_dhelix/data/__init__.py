"""Data: text and tokens in, fixed-shape micro-batches out. Imports nothing else of ds_dhelix.

    corpus   the embedded corpus and its cached byte-level BPE tokenizer
    text     a user's .txt / .jsonl file, its documents, their token ids
    batches  blocks by packing (concat | docs | none), shuffled, sharded over DP, resumable
    inputs   causal-LM targets, positions, attention masks (shared with the op graphs)
"""
from .batches import PACKINGS, TokenDataset, batch_iterator, check_batch_shape
from .corpus import (BOS_ID, BOS_TOKEN, CORPUS_MODULES, DEFAULT_CACHE_DIR, DEFAULT_VOCAB_SIZE, EOS_ID, EOS_TOKEN,
                     PAD_ID, PAD_TOKEN, SPECIAL_TOKENS, build_embedded_corpus, corpus_hash, get_tokenizer,
                     train_tokenizer)
from .inputs import attention_mask, document_positions, hf_model_inputs, shifted_targets, valid_targets
from .text import SUPPORTED_TEXT_SUFFIXES, encode_documents, encode_text, load_text, split_documents

__all__ = ["BOS_ID", "BOS_TOKEN", "CORPUS_MODULES", "DEFAULT_CACHE_DIR", "DEFAULT_VOCAB_SIZE", "EOS_ID", "EOS_TOKEN",
           "PACKINGS", "PAD_ID", "PAD_TOKEN", "SPECIAL_TOKENS", "SUPPORTED_TEXT_SUFFIXES", "TokenDataset",
           "attention_mask", "batch_iterator", "build_embedded_corpus", "check_batch_shape", "corpus_hash",
           "document_positions", "encode_documents", "encode_text", "get_tokenizer", "hf_model_inputs", "load_text",
           "shifted_targets", "split_documents", "train_tokenizer", "valid_targets"]
