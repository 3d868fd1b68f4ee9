"""The token cache (shardfusion.train.token_cache): the packed stream of a corpus, tokenized once, reused while the
tokenizer and the files stay the same, rebuilt when either changes, in the folder beside the data or --data-cache."""

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from shardfusion.train import token_cache  # noqa: E402
from shardfusion.train import tokenizer as tk  # noqa: E402
from shardfusion.train.documents import data_files  # noqa: E402

DOCS = [f"document {i}: the cat sat on the mat, ☃ {'x' * i}\n" for i in range(12)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> tk.Tokenizer:
    return tk.train_bpe(lambda: iter(DOCS * 3), 300, tmp_path_factory.mktemp("bpe"))


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A folder of one JSON Lines file (DOCS[:5]), one Parquet file (DOCS[5:9]) and one text file (DOCS[9:] joined),
    in that path order."""
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:5]), encoding="utf-8")
    pq.write_table(pa.table({"text": DOCS[5:9]}), root / "b.parquet", row_group_size=2)
    (root / "c.txt").write_text("".join(DOCS[9:]), encoding="utf-8")
    return root


@pytest.fixture
def builds(monkeypatch) -> list:
    """Counts the cache's builds (each call of token_cache._build)."""
    calls, real = [], token_cache._build

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)
    monkeypatch.setattr(token_cache, "_build", counted)
    return calls


def tokens(root: Path, tokenizer: tk.Tokenizer, folder: Path, max_bytes: int = 10**6, field: str = "text"):
    return token_cache.cached_tokens(data_files(root), tokenizer, text_field=field, max_bytes=max_bytes,
                                     folder=folder, progress=False)


def expected_stream(hf, texts: list[str], eot: int) -> list[int]:
    """The packing computed with the Hugging Face tokenizer itself: each text's ids, then eot."""
    return [i for t in texts for i in [*hf.encode(t, add_special_tokens=False), eot]]


def test_stream_is_the_packed_documents(tmp_path: Path, corpus: Path, bpe: tk.Tokenizer) -> None:
    """The cached stream is every document's ids (as the HF tokenizer encodes it) then eot, in file order, as a
    read-only uint16 memory map (vocabulary <= 65536); the metadata counts documents, tokens and text bytes."""
    stream, meta = tokens(corpus, bpe, tmp_path / "cache")
    texts = DOCS[:9] + ["".join(DOCS[9:])]
    expected = expected_stream(bpe.hf, texts, bpe.hf.convert_tokens_to_ids("<|endoftext|>"))
    assert stream.dtype == np.uint16 and isinstance(stream, np.memmap) and not stream.flags.writeable
    assert stream.tolist() == expected
    assert (meta["documents"], meta["tokens"]) == (10, len(expected))
    assert meta["text_bytes"] == sum(len(t.encode()) for t in texts)
    assert Path(meta["path"]).stat().st_size == 2 * len(expected)  # little-endian uint16, nothing else
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir()) == [".json", ".lock", ".tokens"]  # no temp


def test_byte_tokenizer_and_bos_packing(tmp_path: Path, corpus: Path) -> None:
    """With bytes the stream is each document's UTF-8 bytes then 0, as uint8; a tokenizer with a bos puts it before
    each document."""
    stream, _ = tokens(corpus, tk.byte_tokenizer(), tmp_path / "cache")
    texts = DOCS[:9] + ["".join(DOCS[9:])]
    assert stream.dtype == np.uint8
    assert stream.tobytes() == b"".join(t.encode() + b"\x00" for t in texts)
    with_bos = tk.Tokenizer(name="bos", vocab_size=256, eot_id=0, bos_id=1, fingerprint="bos-test")
    stream, _ = tokens(corpus, with_bos, tmp_path / "cache")
    assert stream.tobytes() == b"".join(b"\x01" + t.encode() + b"\x00" for t in texts)


def test_id_dtype_widths() -> None:
    """Ids are stored in the narrowest unsigned dtype: 256 ids uint8, 257..65536 uint16, more uint32."""
    width = lambda n: tk.Tokenizer(name="t", vocab_size=n, eot_id=0, bos_id=None, fingerprint="f").id_dtype  # noqa
    assert (width(256), width(257), width(65536), width(65537)) == (np.uint8, np.uint16, np.uint16, np.uint32)


def test_second_call_reuses_the_entry(tmp_path: Path, corpus: Path, bpe: tk.Tokenizer, builds: list,
                                      monkeypatch) -> None:
    """The same corpus and tokenizer open the entry built by the first call: no second build (a build would fail
    here), the same path and the same tokens, and the entry's files are not rewritten."""
    first, meta = tokens(corpus, bpe, tmp_path / "cache")
    assert len(builds) == 1
    stamp = os.stat(meta["path"]).st_mtime_ns
    monkeypatch.setattr(token_cache, "_build", lambda *a, **k: pytest.fail("rebuilt an existing entry"))
    again, meta2 = tokens(corpus, bpe, tmp_path / "cache")
    assert meta2 == meta and np.array_equal(first, again) and os.stat(meta["path"]).st_mtime_ns == stamp


def test_changes_rebuild(tmp_path: Path, corpus: Path, bpe: tk.Tokenizer, builds: list) -> None:
    """Another tokenizer, a touched file, an edited file, another byte cap or another text field each make a new
    entry (a build, another path); going back to an earlier set of inputs reuses its entry."""
    cache = tmp_path / "cache"
    paths = [tokens(corpus, bpe, cache)[1]["path"]]
    paths.append(tokens(corpus, tk.byte_tokenizer(), cache)[1]["path"])
    st = (corpus / "c.txt").stat()
    os.utime(corpus / "c.txt", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: same bytes, newer
    paths.append(tokens(corpus, bpe, cache)[1]["path"])
    with (corpus / "c.txt").open("a") as handle:
        handle.write("one more line\n")
    stream, meta = tokens(corpus, bpe, cache)
    paths.append(meta["path"])
    assert bpe.decode(stream.tolist()).endswith("one more line\n")
    paths.append(tokens(corpus, bpe, cache, max_bytes=100)[1]["path"])
    (corpus / "a.jsonl").write_text(json.dumps({"text": "t", "body": "b"}) + "\n")
    paths.append(tokens(corpus, bpe, cache, field="body", max_bytes=1)[1]["path"])
    assert len(builds) == len(paths) == len(set(paths)) == 6
    tokens(corpus, tk.byte_tokenizer(), cache, field="body", max_bytes=1)
    tokens(corpus, bpe, cache, field="body", max_bytes=1)
    assert len(builds) == 7


def test_failed_build_leaves_no_entry(tmp_path: Path, corpus: Path, bpe: tk.Tokenizer) -> None:
    """A corpus whose reading fails midway raises its ValueError and leaves no entry (nor temporary file) behind:
    the next call fails the same way instead of opening half a stream."""
    (corpus / "d.jsonl").write_text('{"text": "fine"}\n{"text": 3}\n')
    for _ in range(2):
        with pytest.raises(ValueError, match="d.jsonl line 2"):
            tokens(corpus, bpe, tmp_path / "cache")
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".lock"]


def test_cache_folder_default_and_flag(tmp_path: Path, corpus: Path, monkeypatch) -> None:
    """By default the cache is .shardfusion-tokens in the folder that holds --data (for a file and for a folder);
    --data-cache wins; without --data it is the user cache under $XDG_CACHE_HOME."""
    assert token_cache.cache_folder(str(corpus), None) == tmp_path / ".shardfusion-tokens"
    assert token_cache.cache_folder(str(corpus / "a.jsonl"), None) == corpus / ".shardfusion-tokens"
    assert token_cache.cache_folder(str(corpus), str(tmp_path / "elsewhere")) == tmp_path / "elsewhere"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert token_cache.cache_folder(None, None) == tmp_path / "xdg" / "shardfusion" / "tokens"


def test_unusable_cache_folder_names_data_cache(tmp_path: Path, corpus: Path) -> None:
    """A cache folder that cannot be created (a file is in the way) gives a one-line ValueError naming
    --data-cache."""
    (tmp_path / "file").write_text("x")
    for folder in (tmp_path / "file", tmp_path / "file" / "sub"):
        with pytest.raises(ValueError, match="^--data-cache: cannot create") as caught:
            tokens(corpus, tk.byte_tokenizer(), folder)
        assert "\n" not in str(caught.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_cache_folder_names_data_cache(tmp_path: Path, corpus: Path) -> None:
    """An existing folder without write permission: building an entry there gives a ValueError naming --data-cache
    (not a bare PermissionError); an entry already built there still opens."""
    cache = tmp_path / "cache"
    built, _ = tokens(corpus, tk.byte_tokenizer(), cache)
    cache.chmod(0o555)
    try:
        assert np.array_equal(tokens(corpus, tk.byte_tokenizer(), cache)[0], built)
        with pytest.raises(ValueError, match="^--data-cache: cannot write"):
            tokens(corpus, tk.byte_tokenizer(), cache, max_bytes=5)
    finally:
        cache.chmod(0o755)


def test_datasets_folder_tokens_and_key(tmp_path: Path, bpe: tk.Tokenizer, builds: list) -> None:
    """A folder written by `Dataset.save_to_disk` gives the stream of the same texts as JSON Lines (the HF
    tokenizer's ids, eot after each), built once and reused; its key changes with the dataset: another dataset
    saved to the same folder, the fingerprint in state.json alone (files' sizes and mtimes kept), another split of
    a DatasetDict. The key of a corpus of files is what it was before (its entries are reused)."""
    hf = pytest.importorskip("datasets")
    folder, cache = tmp_path / "ds", tmp_path / "cache"
    hf.Dataset.from_dict({"text": DOCS, "n": list(range(len(DOCS)))}).save_to_disk(str(folder))
    lines = tmp_path / "same.jsonl"
    lines.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS), encoding="utf-8")
    stream, meta = tokens(folder, bpe, cache)
    assert stream.tolist() == tokens(lines, bpe, cache)[0].tolist()
    assert stream.tolist() == expected_stream(bpe.hf, DOCS, bpe.hf.convert_tokens_to_ids("<|endoftext|>"))
    assert meta["documents"] == len(DOCS) and len(builds) == 2
    assert tokens(folder, bpe, cache)[1]["path"] == meta["path"] and len(builds) == 2  # reused

    state = folder / "state.json"
    st = state.stat()
    fingerprint = json.loads(state.read_text())["_fingerprint"]
    state.write_text(state.read_text().replace(fingerprint, fingerprint[::-1]))  # same size
    os.utime(state, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert state.stat().st_size == st.st_size and state.stat().st_mtime_ns == st.st_mtime_ns
    paths = [meta["path"], tokens(folder, bpe, cache)[1]["path"]]

    hf.Dataset.from_dict({"text": DOCS[::-1]}).save_to_disk(str(tmp_path / "other"))
    (tmp_path / "other").replace(tmp_path / "old")
    folder.replace(tmp_path / "older")
    (tmp_path / "old").replace(folder)  # another dataset at the same path
    stream, meta = tokens(folder, bpe, cache)
    paths.append(meta["path"])
    assert bpe.decode(stream.tolist()).startswith(DOCS[-1])
    root = tmp_path / "dict"
    hf.DatasetDict({"a": hf.Dataset.from_dict({"text": DOCS}),
                    "b": hf.Dataset.from_dict({"text": DOCS})}).save_to_disk(str(root))
    paths += [token_cache.cached_tokens(data_files(root, split), bpe, text_field="text", max_bytes=10**6,
                                        folder=cache, progress=False)[1]["path"] for split in ("a", "b")]
    assert len(set(paths)) == len(paths) == 5 and len(builds) == 6

    st = lines.stat()  # the key of files is the one entries were written under before datasets folders
    keyed = {"version": token_cache.CACHE_VERSION, "tokenizer": bpe.fingerprint, "text_field": "text",
             "max_bytes": 10**6, "files": [[str(lines.resolve()), st.st_size, st.st_mtime_ns]]}
    digest = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:24]
    assert token_cache.cache_key([lines], bpe, "text", 10**6) == digest
