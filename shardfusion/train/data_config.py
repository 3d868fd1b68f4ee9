"""The data section of the training job's settings (`--data`, `--data-bytes`, `--tokenizer`, `--train-tokenizer`,
`--tokenizer-override`, `--text-field`, `--split`, `--data-cache`) and its checks: this module owns them,
`shardfusion.train.config.JobConfig` composes the section (``config.corpus``) and calls `check_flags` with the other
sections' checks; the job calls `prepare_tokenizer` once before any worker starts (it trains a tokenizer if asked
and checks it against an --init-from folder's and the resumed checkpoint's), whose facts `config.resolve` takes,
then `prepare_corpus` (it tokenizes the corpus into the token cache and checks that each split holds a window);
each worker calls `load_splits`. They take this section, and of the others only what they read: the model section
(--init-from, the window's seq_len) and the run folder (--out). docs/data.md tells the whole story.

Two paths, chosen by the tokenizer and the files (`plain_bytes`):

- `--tokenizer bytes` (the default) on text files: the corpus is the files' raw bytes, concatenated, as before
  tokenizers existed (`shardfusion.train.data.load_corpus`): nothing is cached, the data of older runs are unchanged.
- any other tokenizer, or JSON Lines / Parquet files / a Hugging Face `datasets` folder: the documents
  (`shardfusion.train.documents`) are tokenized once into the token cache (`shardfusion.train.token_cache`), each
  closed by the end-of-text id, and memory-mapped.

Either way the stream is split as before (the last `VAL_FRACTION` is validation) and the batches are the same pure
function of (seed, step, micro-step) (`shardfusion.train.data.BatchSampler`), in tokens instead of bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from shardfusion.train import run_folder
from shardfusion.train import tokenizer as tok
from shardfusion.train.documents import data_files, documents, is_structured, text_bytes
from shardfusion.train.model_config import ModelConfig, shape
from shardfusion.train.sections import FT_SHARED_UNLESS_DEFAULT, meta

RUN_TOKENIZER = run_folder.TOKENIZER
"""OUT/tokenizer: the run's copy of its tokenizer (not for bytes), which an export writes beside the weights."""

DEFAULT_TEXT_FIELD = "text"


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The data settings of a training run (a section of `JobConfig`: ``config.corpus``)."""

    data: str | None = field(default=None, metadata=meta(resume=True))
    """A text file, a JSON Lines file (.jsonl, one JSON object per line), a Parquet file (.parquet, needs pyarrow),
    a folder written by Hugging Face datasets' save_to_disk (needs datasets; a DatasetDict with --split), or a folder
    of such files (recursively, sorted by path) to train on (default: the Python standard library's source)."""
    data_bytes: int = field(default=16_000_000, metadata=meta(resume=True, ft_shared=True))
    """Read at most this many bytes of text of the corpus (JSON Lines and Parquet: whole documents until the text
    reaches it) (default 16000000)."""
    tokenizer: str | None = field(default=None, metadata=meta(saved=True))
    """bytes (one token per byte, vocabulary 256), a Hugging Face tokenizer folder or a tokenizer.json; loaded with
    transformers/tokenizers (pip install 'shardfusion[hf]') (default: the --init-from folder's own tokenizer, or
    bytes)."""
    train_tokenizer: int | None = field(default=None, metadata=meta(saved=True))
    """Train a byte-level BPE tokenizer of at most this many tokens (>= 257) on the training part of --data with the
    tokenizers library, cached beside the data, and train with it; kept in OUT/tokenizer (default: none)."""
    tokenizer_override: bool = False
    """Train with --tokenizer even when it maps text to other ids than the tokenizer of the --init-from folder
    (another ids fingerprint): a warning instead of the error (default off)."""
    text_field: str = field(default=DEFAULT_TEXT_FIELD, metadata=meta(resume=True, ft_shared=True))
    """The field (JSON Lines) or column (Parquet, datasets) that holds each document's text (default text)."""
    split: str | None = field(default=None, metadata=meta(resume=True, ft_shared=FT_SHARED_UNLESS_DEFAULT))
    """The split to train on when --data is a folder written by DatasetDict.save_to_disk, e.g. train (default: none;
    such a folder needs one)."""
    data_cache: str | None = None
    """Folder of the token cache: each corpus is tokenized once per tokenizer and memory-mapped from here
    (default: .shardfusion-tokens beside --data, or ~/.cache/shardfusion/tokens when that is not writable)."""


def check_flags(config: DataConfig, model: ModelConfig) -> None:
    """The data flags on their own, against each other and against --init-from (no file system needed).

    Raises:
        ValueError: one line naming the flag.
    """
    if config.data_bytes < 1:
        raise ValueError(f"--data-bytes must be >= 1, got {config.data_bytes}")
    if config.train_tokenizer is not None:
        if config.tokenizer is not None:
            raise ValueError(f"--train-tokenizer {config.train_tokenizer} with --tokenizer {config.tokenizer}: give "
                             f"one of them")
        if config.train_tokenizer < 257:
            raise ValueError(f"--train-tokenizer {config.train_tokenizer} is too small: a byte-level BPE holds the "
                             f"256 bytes and the end-of-text token, so it needs >= 257")
        if model.init_from is not None:
            raise ValueError(f"--train-tokenizer with --init-from {model.init_from}: a pretrained model keeps the "
                             f"vocabulary it was trained with; drop --train-tokenizer")
    if not config.text_field:
        raise ValueError("--text-field must not be empty")
    if config.split is not None:
        if not config.split:
            raise ValueError("--split must not be empty")
        if config.data is None:
            raise ValueError(f"--split {config.split} needs --data: a folder written by DatasetDict.save_to_disk "
                             f"(the default corpus has no splits)")


def _files(corpus: DataConfig) -> list[Path]:
    if corpus.data is None:
        from shardfusion.train.data import stdlib_files
        return stdlib_files()
    return data_files(Path(corpus.data), corpus.split)


def _run_tokenizer(out: Optional[str]) -> bool:
    """Whether the run folder ``out`` holds the run's own tokenizer (OUT/tokenizer)."""
    return out is not None and tok.is_tokenizer_folder(Path(out) / RUN_TOKENIZER)


def where(corpus: DataConfig) -> str:
    """The corpus in messages: ``--data PATH`` (and ``--split NAME``), or the standard library."""
    if corpus.data is None:
        return "the standard library"
    return f"--data {corpus.data}" + (f" --split {corpus.split}" if corpus.split is not None else "")


def _check_text(corpus: DataConfig) -> bool:
    """Whether the corpus's files are checked to be text (`shardfusion.train.text_files`): those of --data are; the
    standard library's source, the job's own default, is not (a few of its test files are in other encodings on
    purpose)."""
    return corpus.data is not None


def plain_bytes(corpus: DataConfig, model: ModelConfig) -> bool:
    """Whether the run reads raw bytes (`--tokenizer bytes`, text files only): the path of runs before tokenizers."""
    if corpus.tokenizer not in (None, tok.BYTES) or corpus.train_tokenizer is not None:
        return False
    if model.init_from is not None and corpus.tokenizer is None and tok.is_tokenizer_folder(model.init_from):
        return False
    try:
        return not any(is_structured(p) for p in _files(corpus))
    except FileNotFoundError:
        return True  # check_run names the missing --data


def _pretrained_vocab(folder: str) -> Optional[int]:
    try:
        vocab = json.loads((Path(folder) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return vocab if isinstance(vocab, int) else None


def tokenizer_spec(corpus: DataConfig, model: ModelConfig, out: Optional[str], resuming: bool = False) -> str:
    """What `--tokenizer` resolves to, before `--train-tokenizer` (see `prepare`): the flag; else the run's own
    OUT/tokenizer when resuming a run that has one; else the `--init-from` folder when it holds a tokenizer; else
    bytes.

    Raises:
        ValueError: --init-from names a folder without a tokenizer whose model's vocabulary is not the 256 bytes.
    """
    if corpus.tokenizer is not None:
        return corpus.tokenizer
    if resuming and _run_tokenizer(out):
        return str(Path(out) / RUN_TOKENIZER)
    if model.init_from is not None:
        if tok.is_tokenizer_folder(model.init_from):
            return model.init_from
        vocab = _pretrained_vocab(model.init_from)
        if vocab != 256:
            raise ValueError(f"--init-from {model.init_from} holds no tokenizer ({' nor '.join(tok.TOKENIZER_FILES)})"
                             f" and its model's vocabulary is {vocab}, not the 256 bytes: pass the tokenizer it was "
                             f"trained with (--tokenizer PATH), or --tokenizer bytes to feed it bytes anyway")
    return tok.BYTES


def _train_texts(corpus: DataConfig):
    """The documents a tokenizer is trained on: those that begin in the first 1 - VAL_FRACTION of the text, so that
    the validation text is not seen (the split itself is on tokens, close to the same place)."""
    from shardfusion.train.data import VAL_FRACTION
    files = _files(corpus)
    size = 0
    for path in files:  # bytes of text, decompressed, up to the cap
        if size >= corpus.data_bytes:
            break
        size += text_bytes(path, corpus.text_field, corpus.data_bytes - size)
    limit = (1 - VAL_FRACTION) * min(corpus.data_bytes, size)

    def texts():
        seen = 0
        for _, text in documents(files, corpus.text_field, corpus.data_bytes, _check_text(corpus)):
            if seen >= limit:
                return
            seen += len(text.encode("utf-8"))
            yield text
    return texts


def _trained(corpus: DataConfig, progress: bool) -> tok.Tokenizer:
    """`--train-tokenizer N`: the BPE of the corpus and N, trained once and kept in the token cache."""
    from shardfusion.train.token_cache import _locked, cache_folder, cache_key
    files = _files(corpus)
    key = cache_key(files, tok.byte_tokenizer(), corpus.text_field, corpus.data_bytes)
    folder = cache_folder(corpus.data, corpus.data_cache) / f"bpe{corpus.train_tokenizer}-{key}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _locked(folder.with_suffix(".lock")):
        if not tok.is_tokenizer_folder(folder):
            print(f"shardfusion: training a byte-level BPE tokenizer of {corpus.train_tokenizer} tokens on "
                  f"{where(corpus)} into {folder}", flush=True)
            tmp = folder.with_name(folder.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tok.train_bpe(_train_texts(corpus), corpus.train_tokenizer, tmp, progress=progress)
            tmp.replace(folder)
    return tok.load(str(folder))


def resolve_tokenizer(corpus: DataConfig, model: ModelConfig, out: Optional[str], resuming: bool = False,
                      progress: bool = False) -> tok.Tokenizer:
    """The run's tokenizer: trained (`--train-tokenizer`, unless a resumed run has its own copy) or loaded
    (`tokenizer_spec`)."""
    if corpus.train_tokenizer is not None and not (resuming and _run_tokenizer(out)):
        return _trained(corpus, progress)
    return tok.load(tokenizer_spec(corpus, model, out, resuming))


def check_vocabulary(model: ModelConfig, tokenizer: tok.Tokenizer) -> None:
    """A pretrained model (`--init-from`) must have an embedding row for every id of the tokenizer.

    Raises:
        ValueError: naming both sizes.
    """
    if model.init_from is None:
        return
    vocab = _pretrained_vocab(model.init_from)
    if vocab is not None and vocab < tokenizer.vocab_size:
        raise ValueError(f"--init-from {model.init_from}: its model has vocab_size {vocab}, but the tokenizer "
                         f"{tokenizer.name} has {tokenizer.vocab_size} ids; use the tokenizer the model was trained "
                         f"with (--tokenizer PATH)")


def check_pretrained_tokenizer(corpus: DataConfig, model: ModelConfig, tokenizer: tok.Tokenizer) -> Optional[str]:
    """The run's tokenizer must map text to the ids of the tokenizer an `--init-from` folder holds (the same
    `shardfusion.train.tokenizer.ids_fingerprint`): a model's embedding rows mean the ids it was trained with, so
    another tokenizer of the same size would train it on shuffled ids. Nothing to check without --init-from, when
    the folder holds no tokenizer, or when the run's tokenizer is the folder's own. Returns a one-line warning with
    --tokenizer-override, else None.

    Raises:
        ValueError: one line naming both tokenizers and both fingerprints (the first 12 hex digits), unless
            --tokenizer-override; or the folder's tokenizer cannot be loaded.
    """
    init_from = model.init_from
    if init_from is None or not tok.is_tokenizer_folder(init_from):
        return None
    if tokenizer.name == init_from:
        return None
    theirs = tok.folder_ids_fingerprint(init_from)
    ours = tokenizer.ids_fingerprint
    if ours == theirs:
        return None
    source = f"--tokenizer {corpus.tokenizer}" if corpus.tokenizer is not None else f"the tokenizer {tokenizer.name}"
    clash = (f"{source} (ids fingerprint {ours[:12]}, {tokenizer.vocab_size} ids) maps text to other ids than the "
             f"tokenizer of --init-from {init_from} (ids fingerprint {theirs[:12]})")
    if corpus.tokenizer_override:
        return f"{clash}; training with {source} anyway (--tokenizer-override)"
    instead = "drop --tokenizer to use the folder's own, or " if corpus.tokenizer is not None else ""
    raise ValueError(f"{clash}, whose ids the model was trained on; {instead}pass --tokenizer-override to train with "
                     f"{source} anyway")


def check_saved(out: Optional[str], tokenizer: tok.Tokenizer, saved: Optional[dict[str, Any]]) -> None:
    """A resumed run must tokenize as the saved run did (saved: the checkpoint's settings; a checkpoint without a
    fingerprint was written by a byte-level run).

    Raises:
        ValueError: naming the saved tokenizer and this one.
    """
    if saved is None:
        return
    was = saved.get("tokenizer_fingerprint") or tok.BYTES
    if was != tokenizer.fingerprint:
        before = saved.get("tokenizer") or tok.BYTES
        raise ValueError(f"--tokenizer: the checkpoint in --out {out} was trained with the tokenizer {before}, "
                         f"this run's is {tokenizer.name} (another vocabulary or tokenization); resume with the saved "
                         f"run's tokenizer, or use another --out")


def _token_stream(corpus: DataConfig, tokenizer: tok.Tokenizer, progress: bool) -> tuple[np.ndarray, dict]:
    from shardfusion.train.token_cache import cache_folder, cached_tokens
    return cached_tokens(_files(corpus), tokenizer, text_field=corpus.text_field, max_bytes=corpus.data_bytes,
                         folder=cache_folder(corpus.data, corpus.data_cache), progress=progress,
                         where=where(corpus), check_text=_check_text(corpus))


def check_stream(corpus: DataConfig, seq_len: int, n_tokens: int, meta: dict) -> None:
    """Each split of the token stream must hold one window of seq_len + 1 tokens.

    Raises:
        ValueError: naming the corpus, its tokens and what a window needs.
    """
    from shardfusion.train.data import min_corpus_bytes, split_sizes
    need = min_corpus_bytes(seq_len)
    if meta.get("documents", 1) == 0:
        raise ValueError(f"{where(corpus)} holds no documents; pass --data with a non-empty text, JSON Lines, "
                         f"Parquet or datasets file or folder")
    if n_tokens < need:
        n_train, n_val = split_sizes(n_tokens) if n_tokens > 1 else (n_tokens, 0)
        raise ValueError(f"{where(corpus)} holds only {n_tokens} tokens ({meta.get('documents')} documents), which "
                         f"split into {n_train} train / {n_val} val tokens, but each split needs seq_len + 1 = "
                         f"{seq_len + 1} tokens (a corpus of >= {need} tokens); use more data or a smaller --seq-len")


def prepare_tokenizer(corpus: DataConfig, model: ModelConfig, out: Optional[str],
                      saved: Optional[dict[str, Any]] = None, progress: bool = True) -> tok.Tokenizer:
    """Before any worker starts: resolve and load the tokenizer (training it with `--train-tokenizer`), check it
    against the pretrained model (its vocabulary and its tokenizer's ids; local rank 0 prints the warning of
    --tokenizer-override) and the resumed checkpoint. `shardfusion.train.config.resolve` takes its name, vocabulary
    and fingerprint.

    Raises:
        ValueError: one line naming the flag (see the functions above).
    """
    tokenizer = resolve_tokenizer(corpus, model, out, resuming=saved is not None, progress=progress)
    check_vocabulary(model, tokenizer)
    warning = check_pretrained_tokenizer(corpus, model, tokenizer)
    if warning and os.environ.get("LOCAL_RANK", "0") == "0":  # under torchrun every worker runs this: one prints
        print(f"shardfusion: warning: {warning}", flush=True)
    check_saved(out, tokenizer, saved)
    return tokenizer


def prepare_corpus(corpus: DataConfig, model: ModelConfig, tokenizer: tok.Tokenizer, progress: bool = True) -> None:
    """Tokenize the corpus into the cache (unless the run reads plain bytes, which `check_run` checked) and check
    its size (a window of the model's seq_len per split); ``corpus`` is resolved with ``tokenizer``.

    Raises:
        ValueError: one line naming the flag (see `check_stream` and `shardfusion.train.documents`).
    """
    if not plain_bytes(corpus, model):
        stream, meta_ = _token_stream(corpus, tokenizer, progress)
        check_stream(corpus, shape(model).seq_len, len(stream), meta_)


def load_splits(corpus: DataConfig, model: ModelConfig, tokenizer: tok.Tokenizer) -> tuple[Any, Any, dict]:
    """(train, val, info) of a resolved corpus section (`prepare_corpus` ran): 1-D uint8 tensors for plain bytes,
    else read-only numpy views of the cached stream; info: {"tokens", "documents", "text_bytes", "cache"} (documents and cache None for bytes)."""
    from shardfusion.train.data import load_corpus, split_corpus
    if plain_bytes(corpus, model):
        train, val = split_corpus(load_corpus(corpus.data, corpus.data_bytes))
        n = len(train) + len(val)
        return train, val, {"tokens": n, "documents": None, "text_bytes": n, "cache": None}
    stream, meta = _token_stream(corpus, tokenizer, progress=False)
    train, val = split_corpus(stream)
    return train, val, {"tokens": len(stream), "documents": meta["documents"], "text_bytes": meta["text_bytes"],
                        "cache": meta["path"]}


def save_run_tokenizer(out: Path, tokenizer: tok.Tokenizer) -> Optional[Path]:
    """Rank 0, at the start of a run, after `open_outputs`: copy a non-byte tokenizer to OUT/tokenizer (unless it
    is already the one there), so the run folder holds what its checkpoints need to be used; returns the folder
    (None for bytes). A different tokenizer already there is moved to OUT/tokenizer.earlier-<n>, not deleted."""
    if tokenizer.is_bytes:
        return None
    folder = out / RUN_TOKENIZER
    if tok.is_tokenizer_folder(folder) and tok.load(str(folder)).fingerprint == tokenizer.fingerprint:
        return folder
    tmp = out / f"{RUN_TOKENIZER}.tmp-{os.getpid()}"  # of this process: fault-tolerant replica groups share OUT
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save(tmp)
    if tok.is_tokenizer_folder(folder) and tok.load(str(folder)).fingerprint == tokenizer.fingerprint:
        shutil.rmtree(tmp, ignore_errors=True)  # another replica group wrote the same one meanwhile
        return folder
    if folder.exists():  # a tokenizer of another run: kept aside
        n = 1
        while (out / f"{RUN_TOKENIZER}.earlier-{n}").exists():
            n += 1
        folder.replace(out / f"{RUN_TOKENIZER}.earlier-{n}")
    tmp.replace(folder)
    return folder
