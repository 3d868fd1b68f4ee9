"""Tokenizers of the training job: the byte tokenizer (`--tokenizer bytes`, the default) and Hugging Face tokenizers
(`--tokenizer PATH`, a tokenizer folder or a ``tokenizer.json``; `--train-tokenizer N`, a byte-level BPE trained on
the corpus with the `tokenizers` library). See docs/data.md.

Everything here that reads, trains or writes a Hugging Face tokenizer goes through the `tokenizers` and
`transformers` libraries (optional extras: ``pip install 'shardfusion[hf]'``); nothing is imported before a function
that needs it runs, so the job's byte path never loads them.

A `Tokenizer` gives the job what it needs and nothing more: `vocab_size` (ids are in [0, vocab_size)), the
end-of-text id that closes each document when documents are packed (`eot_id`), an optional `bos_id` that opens
each, `encode_batch` / `decode`, `token_bytes` (how many UTF-8 bytes each id stands for, for bits per byte), a
`fingerprint` that changes with every change of the tokenization (the token cache and the resume checks are keyed by
it), an `ids_fingerprint` of what maps text to ids alone (compared with a pretrained folder's tokenizer) and `save`
(a folder that ``transformers.AutoTokenizer.from_pretrained`` loads).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np

# The byte-level tokenizer is the library's (the export writes it beside the weights); the job re-exports it.
from shardfusion.checkpoint.export_tokenizer import INSTALL_HINT, byte_alphabet, hf_byte_tokenizer  # noqa: F401

BYTES = "bytes"
"""`--tokenizer bytes`: one token per byte, vocabulary 256."""

BYTE_EOT = 0
"""End-of-text id of the byte tokenizer, used only between documents of JSON Lines / Parquet data (text files are
read as one raw byte stream, as before tokenizers existed): the NUL byte, which text does not contain; the 256
byte values leave no id to spare."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""Files whose presence makes a folder (e.g. an `--init-from` folder) a Hugging Face tokenizer folder."""

EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")
"""Token strings taken as end-of-text when a tokenizer names no eos_token, in this order."""

TRAINED_EOT = "<|endoftext|>"
"""The one special token of a tokenizer trained by `--train-tokenizer`."""

_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")  # SentencePiece byte fallback: one byte


def _first_line(error: BaseException) -> str:
    """The first line of an error's message, or its type's name when it has none."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _import(what: str, module: str) -> Any:
    try:
        return __import__(module)
    except ImportError as error:
        raise ValueError(f"{what} needs the {module} package ({INSTALL_HINT}): {error}") from None


@dataclass(frozen=True, eq=False)
class Tokenizer:
    """A tokenizer as the job uses it; build one with `load`, `train_bpe` or `byte_tokenizer`."""

    name: str
    """`BYTES`, or the path it was loaded from."""
    vocab_size: int
    """Number of ids, special tokens included: every id is in [0, vocab_size)."""
    eot_id: int
    """Id appended after each document when documents are packed into one stream."""
    bos_id: Optional[int]
    """Id put before each document when the tokenizer has a beginning-of-sequence token distinct from eot (as
    Llama's does), else None."""
    fingerprint: str
    """Hex digest of everything that decides the ids (the tokenizer's serialized model, eot and bos)."""
    hf: Any = None
    """The `transformers` tokenizer, None for bytes."""

    @property
    def is_bytes(self) -> bool:
        return self.hf is None

    @property
    def id_dtype(self) -> np.dtype:
        """The narrowest unsigned dtype that holds every id: uint8, uint16 or uint32."""
        for dtype in (np.uint8, np.uint16, np.uint32):
            if self.vocab_size - 1 <= np.iinfo(dtype).max:
                return np.dtype(dtype)
        raise ValueError(f"vocabulary of {self.vocab_size} ids is too large")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text, no special tokens added (the packing adds eot and bos)."""
        if self.hf is None:
            return [list(t.encode("utf-8")) for t in texts]
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is not None:  # the fast path: the Rust tokenizer on the whole batch
            return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        return self.hf(texts, add_special_tokens=False)["input_ids"]

    def document_ids(self, texts: list[str]) -> Iterator[list[int]]:
        """Each text's ids as packed: bos (if any), the text's ids, eot."""
        head = [] if self.bos_id is None else [self.bos_id]
        for ids in self.encode_batch(texts):
            yield [*head, *ids, self.eot_id]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids; invalid UTF-8 becomes U+FFFD; special tokens are dropped."""
        ids = [int(i) for i in ids]
        if self.hf is None:
            return bytes(i for i in ids if i != BYTE_EOT).decode("utf-8", errors="replace")
        return self.hf.decode(ids, skip_special_tokens=True)

    def token_bytes(self) -> np.ndarray:
        """(vocab_size,) int64: the UTF-8 bytes each id stands for; 0 for special tokens. Exact for the byte
        tokenizer and byte-level BPE (GPT-2, Llama 3, Qwen, `--train-tokenizer`: each character of a token is one
        byte); for SentencePiece vocabularies, byte-fallback tokens count 1 and "▁" counts as the space it is."""
        if self.hf is None:
            return np.ones(256, dtype=np.int64)
        special = set(self.hf.all_special_ids)
        byte_level = _byte_level(self.hf)
        table = np.zeros(self.vocab_size, dtype=np.int64)
        for i, token in enumerate(self.hf.convert_ids_to_tokens(list(range(self.vocab_size)))):
            if i in special or token is None:
                continue
            if byte_level:
                table[i] = len(token)
            elif _BYTE_TOKEN.match(token):
                table[i] = 1
            else:
                table[i] = len(token.replace("▁", " ").encode("utf-8"))
        return table

    def save(self, folder: str | Path) -> None:
        """Write the tokenizer so that ``AutoTokenizer.from_pretrained(folder)`` loads it (`save_pretrained`; for
        bytes, the byte-level equivalent of `hf_byte_tokenizer`)."""
        (self.hf if self.hf is not None else hf_byte_tokenizer()).save_pretrained(str(folder))

    @property
    def ids_fingerprint(self) -> str:
        """`ids_fingerprint` of the tokenizer; for bytes, that of `hf_byte_tokenizer` (whose ids are the bytes), so
        the byte tokenizer matches the tokenizer an export of a byte-level run writes."""
        return ids_fingerprint(self.hf if self.hf is not None else hf_byte_tokenizer())

    def describe(self) -> str:
        if self.hf is None:
            return "bytes (vocabulary 256)"
        return f"{self.name} (vocabulary {self.vocab_size:,}, end of text {self.eot_id})"


def _byte_level(hf: Any) -> bool:
    """Whether the tokenizer decodes with a ByteLevel decoder (alone or in a Sequence)."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(part.get("type") == "ByteLevel" for part in parts)


def byte_tokenizer() -> Tokenizer:
    """`--tokenizer bytes`: id = byte value."""
    return Tokenizer(name=BYTES, vocab_size=256, eot_id=BYTE_EOT, bos_id=None, fingerprint=BYTES)


def _eot(hf: Any, where: str) -> int:
    if hf.eos_token_id is not None:
        return int(hf.eos_token_id)
    vocab = hf.get_vocab()
    for name in EOT_NAMES:
        if name in vocab:
            return int(vocab[name])
    raise ValueError(f"--tokenizer {where}: the tokenizer names no end-of-text token (no eos_token, and none of "
                     f"{', '.join(EOT_NAMES)} in its vocabulary); documents cannot be separated")


def _wrap(hf: Any, name: str) -> Tokenizer:
    eot = _eot(hf, name)
    bos = hf.bos_token_id
    bos = None if bos is None or int(bos) == eot else int(bos)
    backend = getattr(hf, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(hf.get_vocab(), sort_keys=True)
    digest = hashlib.sha256(f"{body}\neot={eot}\nbos={bos}".encode()).hexdigest()
    return Tokenizer(name=name, vocab_size=len(hf), eot_id=eot, bos_id=bos, fingerprint=digest, hf=hf)


def ids_fingerprint(hf: Any) -> str:
    """SHA-256 (hex) of what decides which ids a text gets: the model (vocabulary token -> id, merges and its
    options), the added tokens (id and content), the normalizer and the pre-tokenizer. Two tokenizers with the same
    vocabulary size but other ids differ here; a copy written by ``save_pretrained`` does not. Unlike
    `Tokenizer.fingerprint` it leaves out what does not change ids (decoder, post-processor, padding, truncation)
    and the end-of-text and bos choice. hf: a ``transformers`` tokenizer (a slow one: its vocabulary alone)."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        body: Any = {"class": type(hf).__name__, "vocab": hf.get_vocab()}
    else:
        spec = json.loads(backend.to_str())
        added = sorted((t["id"], t["content"]) for t in spec.get("added_tokens") or [])
        body = {"model": spec.get("model"), "added_tokens": added, "normalizer": spec.get("normalizer"),
                "pre_tokenizer": spec.get("pre_tokenizer")}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def folder_ids_fingerprint(folder: str | Path) -> str:
    """`ids_fingerprint` of the tokenizer in a Hugging Face folder (``AutoTokenizer.from_pretrained``; it needs no
    end-of-text token, unlike `load`).

    Raises:
        ValueError: one line naming the folder: transformers is missing or the tokenizer cannot be loaded.
    """
    transformers = _import(f"the tokenizer of {folder}", "transformers")
    try:
        hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    except Exception as error:  # the libraries raise many kinds; the user needs one line
        raise ValueError(f"{folder}: cannot load its tokenizer: {_first_line(error)}") from None
    return ids_fingerprint(hf)


def is_tokenizer_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding a Hugging Face tokenizer (`TOKENIZER_FILES`)."""
    return Path(path).is_dir() and any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def load(spec: str) -> Tokenizer:
    """The tokenizer `--tokenizer spec` names: `BYTES`; a Hugging Face tokenizer folder
    (``AutoTokenizer.from_pretrained``); or a ``tokenizer.json`` file (``PreTrainedTokenizerFast``, eos found among
    `EOT_NAMES`).

    Raises:
        ValueError: one line naming --tokenizer: the path does not exist or holds no tokenizer, the libraries are
            missing, the file cannot be read, or there is no end-of-text token.
    """
    if spec == BYTES:
        return byte_tokenizer()
    path = Path(spec)
    what = f"--tokenizer {spec}"
    if not path.exists():
        raise ValueError(f"{what}: no such file or folder (give a Hugging Face tokenizer folder, a tokenizer.json, "
                         f"or bytes)")
    if path.is_dir() and not is_tokenizer_folder(path):
        raise ValueError(f"{what}: the folder holds neither {' nor '.join(TOKENIZER_FILES)}")
    transformers = _import(what, "transformers")
    try:
        if path.is_dir():
            hf = transformers.AutoTokenizer.from_pretrained(str(path))
        else:
            hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
            vocab = hf.get_vocab()
            eot = next((n for n in EOT_NAMES if n in vocab), None)
            if eot is not None:
                hf.eos_token = eot
    except Exception as error:  # the libraries raise many kinds (ValueError too); the user needs one line
        raise ValueError(f"{what}: cannot load it as a Hugging Face tokenizer: {_first_line(error)}") from None
    return _wrap(hf, str(spec))


def train_bpe(texts: Callable[[], Iterator[str]], vocab_size: int, folder: str | Path,
              progress: bool = False) -> Tokenizer:
    """Train a byte-level BPE tokenizer of ``vocab_size`` ids (the 256 bytes, `TRAINED_EOT`, and merges) on the
    texts with the `tokenizers` library's BpeTrainer, save it to ``folder`` (`Tokenizer.save`) and return it loaded
    from there. Deterministic for the same texts in the same order.

    Raises:
        ValueError: vocab_size < 257 (the bytes and the end-of-text token), or the libraries are missing.
    """
    if vocab_size < 257:
        raise ValueError(f"--train-tokenizer {vocab_size} is too small: a byte-level BPE holds the 256 bytes and the "
                         f"end-of-text token, so it needs >= 257")
    tokenizers = _import(f"--train-tokenizer {vocab_size}", "tokenizers")
    transformers = _import(f"--train-tokenizer {vocab_size}", "transformers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[TRAINED_EOT],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                                             show_progress=progress)
    tok.train_from_iterator(texts(), trainer=trainer)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=TRAINED_EOT, model_max_length=int(1e30))
    Path(folder).mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(folder))
    return load(str(folder))
