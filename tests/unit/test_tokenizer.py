"""The job's tokenizers (shardfusion.train.tokenizer): the byte tokenizer and its Hugging Face twin, a byte-level BPE
trained with `train_bpe`, `token_bytes`, and `load` of folders, files and things that are not tokenizers. Every
tokenizer is built locally (no hub)."""

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from shardfusion.train import tokenizer as tk  # noqa: E402

TEXTS = [f"the quick brown fox {i} jumps over the lazy dog; héllo wörld ☃\n" * 3 for i in range(40)]
"""A small corpus with repeats (merges to learn) and non-ASCII characters."""

HARD = ["plain ascii", "héllo wörld ☃ 日本語 😀", "a\x00b\nc\r\n\td", "  two leading spaces", "", "\n\n",
        "".join(chr(c) for c in range(256))]
"""Strings a tokenizer must carry byte for byte: non-ASCII of 2, 3 and 4 bytes, NUL, newlines, every code point
below 256."""


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bpe")
    tk.train_bpe(lambda: iter(TEXTS), 300, folder)
    return folder


def test_byte_tokenizer_ids_are_utf8_bytes() -> None:
    """`bytes`: 256 ids, eot 0 (NUL), no bos, uint8; a text's ids are its UTF-8 bytes, each id 1 byte long; a
    document is its bytes then 0; decode drops the NUL separators."""
    t = tk.byte_tokenizer()
    assert (t.vocab_size, t.eot_id, t.bos_id, t.is_bytes, t.id_dtype) == (256, 0, None, True, np.uint8)
    assert t.encode_batch(HARD) == [list(s.encode("utf-8")) for s in HARD]
    assert list(t.document_ids(["é"])) == [[0xC3, 0xA9, 0]]
    assert t.decode(list("a☃".encode()) + [0]) == "a☃"
    assert np.array_equal(t.token_bytes(), np.ones(256, dtype=np.int64))
    assert tk.load("bytes").fingerprint == t.fingerprint == "bytes"


def test_byte_alphabet_is_gpt2s() -> None:
    """`byte_alphabet` is GPT-2's bytes_to_unicode table (as transformers has it) and the alphabet of the
    tokenizers library's ByteLevel pre-tokenizer."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    import tokenizers
    assert tk.byte_alphabet() == bytes_to_unicode()
    assert set(tk.byte_alphabet().values()) == set(tokenizers.pre_tokenizers.ByteLevel.alphabet())


@pytest.mark.parametrize("write", ["hf_byte_tokenizer", "Tokenizer.save"])
def test_hf_byte_tokenizer_reloads_as_bytes(tmp_path: Path, write: str) -> None:
    """The byte tokenizer written for export (`hf_byte_tokenizer().save_pretrained`, or `Tokenizer.save` of bytes)
    and reloaded by `AutoTokenizer.from_pretrained` has 256 ids, encodes every string to exactly its UTF-8 byte
    values and decodes them back."""
    if write == "hf_byte_tokenizer":
        tk.hf_byte_tokenizer().save_pretrained(str(tmp_path))
    else:
        tk.byte_tokenizer().save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(hf) == 256
    for text in HARD:
        ids = hf.encode(text, add_special_tokens=False)
        assert ids == list(text.encode("utf-8")), repr(text)
        assert hf.decode(ids) == text
    assert hf.convert_tokens_to_ids([tk.byte_alphabet()[b] for b in range(256)]) == list(range(256))


def test_train_bpe_is_deterministic_and_round_trips(tmp_path: Path, bpe_folder: Path) -> None:
    """Training twice on the same texts writes the same tokenizer.json (same fingerprint); at most N ids; the one
    special token, `<|endoftext|>`, is eot and the eos; no bos; uint16 ids; encode/decode round trips, unseen
    characters included; another N is another fingerprint."""
    again = tk.train_bpe(lambda: iter(TEXTS), 300, tmp_path / "again")
    first = tk.load(str(bpe_folder))
    assert (bpe_folder / "tokenizer.json").read_bytes() == (tmp_path / "again" / "tokenizer.json").read_bytes()
    assert again.fingerprint == first.fingerprint
    assert 257 <= first.vocab_size <= 300
    assert first.hf.convert_ids_to_tokens(first.eot_id) == "<|endoftext|>" == first.hf.eos_token
    assert first.bos_id is None and first.id_dtype == np.uint16
    for text in TEXTS[:3] + HARD:
        ids = first.encode_batch([text])[0]
        assert first.eot_id not in ids and all(0 <= i < first.vocab_size for i in ids)
        assert first.decode(ids) == text
    assert len(first.encode_batch([TEXTS[0]])[0]) < len(TEXTS[0].encode()) / 2  # merges were learnt
    other = tk.train_bpe(lambda: iter(TEXTS), 280, tmp_path / "other")
    assert other.vocab_size <= 280 and other.fingerprint != first.fingerprint


def test_train_bpe_refuses_fewer_than_257_ids(tmp_path: Path) -> None:
    """A byte-level BPE needs the 256 bytes and eot: N = 256 is refused, naming --train-tokenizer."""
    with pytest.raises(ValueError, match="--train-tokenizer 256 is too small"):
        tk.train_bpe(lambda: iter(TEXTS), 256, tmp_path)


def test_token_bytes_of_byte_level_bpe(bpe_folder: Path) -> None:
    """Byte-level BPE: summed over a text's ids, `token_bytes` is the text's UTF-8 length; eot counts 0; every
    token that decodes alone to valid text counts the bytes of that text."""
    t = tk.load(str(bpe_folder))
    table = t.token_bytes()
    assert table.shape == (t.vocab_size,) and table[t.eot_id] == 0
    for text in TEXTS[:3] + HARD:
        ids = t.encode_batch([text])[0]
        assert int(table[ids].sum()) == len(text.encode("utf-8")), repr(text)
    doc = next(t.document_ids([TEXTS[0]]))
    assert doc[-1] == t.eot_id and int(table[doc].sum()) == len(TEXTS[0].encode())
    for i in range(t.vocab_size):
        piece = t.hf.decode([i])
        if i != t.eot_id and "\ufffd" not in piece:
            assert table[i] == len(piece.encode("utf-8")) >= 1, i


def test_load_folder_and_file_agree(bpe_folder: Path) -> None:
    """`load` of the tokenizer folder and of its tokenizer.json alone give the same tokenizer: fingerprint,
    vocabulary, eot (found by name in the file) and ids."""
    folder, file = tk.load(str(bpe_folder)), tk.load(str(bpe_folder / "tokenizer.json"))
    assert (folder.fingerprint, folder.vocab_size, folder.eot_id) == (file.fingerprint, file.vocab_size, file.eot_id)
    assert folder.encode_batch(TEXTS[:2]) == file.encode_batch(TEXTS[:2])
    assert tk.is_tokenizer_folder(bpe_folder) and not tk.is_tokenizer_folder(bpe_folder / "tokenizer.json")


def test_bos_distinct_from_eot_opens_each_document(tmp_path: Path) -> None:
    """A tokenizer with a bos other than its eos (as Llama's) packs each document as bos, ids, eos."""
    import tokenizers
    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 4}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>",
                                         unk_token="[UNK]").save_pretrained(str(tmp_path))
    t = tk.load(str(tmp_path))
    assert (t.bos_id, t.eot_id, t.vocab_size) == (0, 1, 5)
    assert list(t.document_ids(["hello world", "world"])) == [[0, 3, 4, 1], [0, 4, 1]]
    assert t.token_bytes()[[0, 1]].tolist() == [0, 0]


def _one_line_error(spec: str, *words: str) -> str:
    with pytest.raises(ValueError) as caught:
        tk.load(spec)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"--tokenizer {spec}"), message
    for word in words:
        assert word in message, message
    return message


def test_load_refuses_what_is_not_a_tokenizer(tmp_path: Path) -> None:
    """A missing path, a folder without tokenizer files, a folder or file whose tokenizer.json is garbage, and a
    tokenizer without any end-of-text token each give one line naming --tokenizer and the path."""
    import tokenizers
    _one_line_error(str(tmp_path / "missing"), "no such file or folder")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("hi")
    _one_line_error(str(tmp_path / "plain"), "tokenizer.json")
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "tokenizer.json").write_text("this is not json {")
    _one_line_error(str(tmp_path / "garbage"), "cannot load")
    _one_line_error(str(tmp_path / "garbage" / "tokenizer.json"), "cannot load")
    (tmp_path / "binary.json").write_bytes(b"\x00\xff\xfe\x80")
    _one_line_error(str(tmp_path / "binary.json"), "cannot load")
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    model.save(str(tmp_path / "no_eot.json"))
    _one_line_error(str(tmp_path / "no_eot.json"), "end-of-text")


def test_ids_fingerprint_tells_other_ids_apart(tmp_path: Path, bpe_folder: Path) -> None:
    """`ids_fingerprint` is the same for a tokenizer, its folder read by AutoTokenizer, its tokenizer.json and a
    save_pretrained copy; it differs for a BPE of the same size trained on other text (same size, other ids), and
    for the same vocabulary with two ids swapped; the byte tokenizer's is its Hugging Face twin's, saved or not."""
    bpe = tk.load(str(bpe_folder))
    bpe.save(tmp_path / "copy")
    same = {bpe.ids_fingerprint, tk.folder_ids_fingerprint(bpe_folder), tk.load(str(tmp_path / "copy")).ids_fingerprint,
            tk.load(str(bpe_folder / "tokenizer.json")).ids_fingerprint}
    assert len(same) == 1 and len(bpe.ids_fingerprint) == 64
    other = tk.train_bpe(lambda: iter([f"zebras {i} jump ✓ over tall fences\n" for i in range(60)]), 300,
                         tmp_path / "other")
    assert other.vocab_size == bpe.vocab_size and other.ids_fingerprint != bpe.ids_fingerprint
    spec = json.loads((bpe_folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "swapped.json").write_text(json.dumps(spec))
    assert tk.load(str(tmp_path / "swapped.json")).ids_fingerprint != bpe.ids_fingerprint
    tk.byte_tokenizer().save(tmp_path / "bytes")
    assert tk.byte_tokenizer().ids_fingerprint == tk.folder_ids_fingerprint(tmp_path / "bytes")
    with pytest.raises(ValueError, match="^.*nowhere: cannot load its tokenizer"):
        tk.folder_ids_fingerprint(tmp_path / "nowhere")
