"""Data: text and tokens in, fixed-shape micro-batches out. Imports nothing else of ds_dhelix.

corpus   the embedded corpus and its cached byte-level BPE tokenizer
text     a .txt file, its documents, their token ids
records  data files through datasets, their format, token ids + loss masks (RecordEncoder)
packing  encoded records -> blocks (Packer), what the loss sees (PackStats)
preference  prompt/chosen/rejected records -> paired rows for a preference objective (PairDataset)
rollouts  a prompt's sampled completions with rewards -> rows for GRPO's update
sources  DataOptions -> load_data -> TrainingData (train / eval blocks or a stream)
batches  blocks by packing (concat | docs | none), shuffled, sharded over DP, resumable
inputs   causal-LM targets, positions, attention masks (shared with the op graphs)
"""

from .batches import (
    PACKINGS,
    BlockDataset,
    TokenDataset,
    batch_iterator,
    block_batches,
    check_batch_shape,
    stream_batches,
)
from .corpus import (
    BOS_ID,
    BOS_TOKEN,
    CORPUS_MODULES,
    DEFAULT_CACHE_DIR,
    DEFAULT_VOCAB_SIZE,
    EOS_ID,
    EOS_TOKEN,
    PAD_ID,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    build_embedded_corpus,
    corpus_hash,
    get_tokenizer,
    train_tokenizer,
)
from .inputs import attention_mask, document_positions, hf_model_inputs, shifted_targets, valid_targets
from .packing import Packer, PackStats
from .records import CHATML_TEMPLATE, FORMATS, LOSS_ON, RecordEncoder, detect_format, open_records
from .sources import DataOptions, TrainingData, load_data
from .text import SUPPORTED_TEXT_SUFFIXES, encode_documents, encode_text, load_text, split_documents

__all__ = [
    "BlockDataset",
    "CHATML_TEMPLATE",
    "DataOptions",
    "FORMATS",
    "LOSS_ON",
    "PackStats",
    "Packer",
    "RecordEncoder",
    "TrainingData",
    "block_batches",
    "detect_format",
    "load_data",
    "open_records",
    "stream_batches",
    "BOS_ID",
    "BOS_TOKEN",
    "CORPUS_MODULES",
    "DEFAULT_CACHE_DIR",
    "DEFAULT_VOCAB_SIZE",
    "EOS_ID",
    "EOS_TOKEN",
    "PACKINGS",
    "PAD_ID",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "SUPPORTED_TEXT_SUFFIXES",
    "TokenDataset",
    "attention_mask",
    "batch_iterator",
    "build_embedded_corpus",
    "check_batch_shape",
    "corpus_hash",
    "document_positions",
    "encode_documents",
    "encode_text",
    "get_tokenizer",
    "hf_model_inputs",
    "load_text",
    "shifted_targets",
    "split_documents",
    "train_tokenizer",
    "valid_targets",
]
