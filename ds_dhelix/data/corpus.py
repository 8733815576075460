"""Training text without downloads: the embedded corpus and its tokenizer.

build_embedded_corpus()  pydoc topics + stdlib docstrings (~1 MB of English, deterministic)
    -> get_tokenizer()   byte-level BPE, trained once and cached on disk by (vocab, corpus hash)
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import shutil
import tempfile
from collections.abc import Iterator

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
"""Trained first, so their ids are 0, 1, 2 (the ids the hf_models presets use)."""
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
DEFAULT_VOCAB_SIZE = 2048
DEFAULT_CACHE_DIR = "~/.cache/ds_dhelix"
_TOKENIZER_FORMAT = 1  # bump when the training recipe changes, to invalidate cached tokenizers

# Fixed list, fixed order. Pure-Python modules are read as source, never imported.
CORPUS_MODULES = (
    "_collections_abc",
    "abc",
    "argparse",
    "ast",
    "base64",
    "bisect",
    "builtins",
    "calendar",
    "cmd",
    "codecs",
    "collections",
    "concurrent.futures._base",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "difflib",
    "email.message",
    "enum",
    "fractions",
    "functools",
    "gettext",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html.parser",
    "http.client",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "locale",
    "logging",
    "mailbox",
    "math",
    "numbers",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "selectors",
    "shlex",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "time",
    "timeit",
    "tokenize",
    "traceback",
    "types",
    "typing",
    "unittest.case",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "weakref",
    "xml.etree.ElementTree",
    "zipfile",
)


# --------------------------------------------------------------------------------------------------
# corpus
# --------------------------------------------------------------------------------------------------


@functools.cache
def build_embedded_corpus() -> str:
    """Python's help topics plus the docstrings of `CORPUS_MODULES`, in a fixed order. No download."""
    from pydoc_data.topics import topics

    parts = [f"# {name}\n\n{topics[name].strip()}" for name in sorted(topics)]
    seen: set[str] = set()
    for module_name in CORPUS_MODULES:
        parts.extend(_module_docs(module_name, seen))
    return "\n\n".join(parts) + "\n"


def _module_docs(module_name: str, seen: set[str]) -> list[str]:
    """Module, class, method and function docstrings of one stdlib module, each part "## title" + doc.

    Pure-Python modules are read from their source (ast), so what other libraries patch into a module
    at runtime (pytest replaces threading.excepthook, transformers adds Logger.warning_once) cannot
    change the corpus. C modules (builtins, math, ...) are introspected. Missing modules are skipped.
    """
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return []
    if spec.origin and spec.origin.endswith(".py") and os.path.isfile(spec.origin):
        with open(spec.origin, encoding="utf-8") as f:
            docs = _source_docs(module_name, ast.parse(f.read()))
    else:
        docs = _runtime_docs(module_name)
    out = []
    for title, doc in docs:
        doc = inspect.cleandoc(doc) if doc else ""
        if len(doc) >= 40 and doc not in seen:
            seen.add(doc)
            out.append(f"## {title}\n\n{doc}")
    return out


def _source_docs(module_name: str, tree: ast.Module) -> Iterator[tuple[str, str | None]]:
    yield module_name, ast.get_docstring(tree, clean=False)
    defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, defs) and not node.name.startswith("_"):
            yield f"{module_name}.{node.name}", ast.get_docstring(node, clean=False)
            if isinstance(node, ast.ClassDef):
                for member in node.body:
                    if isinstance(member, defs) and not member.name.startswith("_"):
                        yield f"{module_name}.{node.name}.{member.name}", ast.get_docstring(member, clean=False)


def _runtime_docs(module_name: str) -> Iterator[tuple[str, str | None]]:
    module = importlib.import_module(module_name)
    yield module_name, module.__doc__
    for name in sorted(vars(module)):
        obj = vars(module)[name]
        if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
            continue  # private, or not defined here (re-exported or patched in)
        if inspect.isclass(obj) or inspect.isroutine(obj):
            yield f"{module_name}.{name}", obj.__doc__
        if inspect.isclass(obj):
            for attr, member in sorted(vars(obj).items()):
                if not attr.startswith("_") and inspect.isroutine(member):
                    yield f"{module_name}.{name}.{attr}", member.__doc__


def corpus_hash(text: str) -> str:
    """Short content hash (sha256 prefix) used in cache keys."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------------


def train_tokenizer(text: str, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train a byte-level BPE on ``text``; returns a transformers `PreTrainedTokenizerFast`.

    Byte-level means every string round-trips: ``decode(encode(x)) == x``. Ids 0/1/2 are pad/bos/eos.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    smallest = 256 + len(SPECIAL_TOKENS)  # every byte + the specials
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < smallest:
        raise ValueError(f"vocab_size must be an int >= {smallest} (256 bytes + specials), got {vocab_size!r}")
    if not text:
        raise ValueError("cannot train a tokenizer on empty text")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    chunks = text.split("\n\n")  # paragraphs: lets the trainer count words in parallel
    tok.train_from_iterator(chunks, trainer=trainer, length=len(chunks))
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [PAD_ID, BOS_ID, EOS_ID]
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)


def get_tokenizer(cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """The embedded-corpus tokenizer, trained once and cached under ``cache_dir``.

    Cache key = (vocab size, corpus hash). Safe when several ranks call at once: each trains into a
    private temp dir and atomically renames it into place; a rank that loses the race uses the winner's.
    """
    from transformers import PreTrainedTokenizerFast

    text = build_embedded_corpus()
    root = os.path.expanduser(os.fspath(cache_dir))
    final = os.path.join(root, f"tokenizer-f{_TOKENIZER_FORMAT}-v{vocab_size}-{corpus_hash(text)}")
    if not os.path.isfile(os.path.join(final, "tokenizer.json")):
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-tokenizer-", dir=root)
        try:
            train_tokenizer(text, vocab_size).save_pretrained(tmp)
            os.rename(tmp, final)  # atomic; fails if another rank already put its copy there
        except OSError:
            if not os.path.isfile(os.path.join(final, "tokenizer.json")):
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return PreTrainedTokenizerFast.from_pretrained(final, local_files_only=True)
