"""The corpus readers (shardfusion.train.documents): text, JSON Lines and Parquet files, folders in path order
without hidden entries, the byte cap, compressed files (decompressed), files that are not text (refused), and the
one-line errors that name --data, the file and the line."""

import json
from pathlib import Path

import pytest

from shardfusion.train.documents import data_files, documents, file_documents, is_structured, text_bytes

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def read(path: Path, field: str = "text") -> list[str]:
    return list(file_documents(path, field))


def error_of(path: Path, field: str = "text") -> str:
    """The message of the ValueError that reading `path` raises; it must be one line naming --data and the file."""
    with pytest.raises(ValueError) as caught:
        read(path, field)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("--data") and str(path) in message, message
    return message


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_jsonl_text_field_and_blank_lines(tmp_path: Path) -> None:
    """JSON Lines: each object's "text" is a document, in file order, other fields ignored; blank and
    whitespace-only lines are skipped; a custom --text-field reads another field; .ndjson is JSON Lines too."""
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "first", "id": 1}\n\n   \n{"text": "sé\\ncond ☃"}\n{"id": 3, "text": ""}\n',
                    encoding="utf-8")
    assert read(path) == ["first", "sé\ncond ☃", ""]
    custom = write_jsonl(tmp_path / "b.ndjson", [{"body": "x", "text": 1}, {"body": "y"}])
    assert read(custom, "body") == ["x", "y"]


def test_jsonl_errors_name_the_line(tmp_path: Path) -> None:
    """A missing field names the line number (blank lines counted) and the fields the line has; a line that is not
    JSON, a JSON value that is not an object, and a field that is not a string are refused with their line."""
    path = tmp_path / "missing.jsonl"
    path.write_text('{"text": "ok"}\n\n{"title": "t", "body": "b"}\n')
    message = error_of(path)
    assert "line 3" in message and "'text'" in message and "title, body" in message and "--text-field" in message
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
    assert "line 2: not JSON" in error_of(tmp_path / "bad.jsonl")
    write_jsonl(tmp_path / "list.jsonl", [[1, 2]])
    assert "line 1" in error_of(tmp_path / "list.jsonl")
    write_jsonl(tmp_path / "num.jsonl", [{"text": "a"}, {"text": 7}])
    message = error_of(tmp_path / "num.jsonl")
    assert "line 2" in message and "int" in message and "not a string" in message


def test_parquet_row_groups_and_nulls(tmp_path: Path) -> None:
    """Parquet: the text column's rows in order across several row groups, a null row skipped, other columns
    ignored; --text-field picks another column."""
    rows = [f"document {i} ☃" for i in range(7)]
    values = rows[:3] + [None] + rows[3:]
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"id": list(range(8)), "text": values, "alt": [str(i) for i in range(8)]}), path,
                   row_group_size=3)
    assert pq.ParquetFile(path).num_row_groups == 3
    assert read(path) == rows
    assert read(path, "alt") == [str(i) for i in range(8)]


def test_parquet_errors(tmp_path: Path) -> None:
    """A missing column names the columns there are; a non-string column, a text file named .parquet, an empty
    .parquet and a truncated one give one-line errors naming the file."""
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"title": ["a"], "n": [1]}), path)
    message = error_of(path)
    assert "'text'" in message and "title, n" in message and "--text-field" in message
    assert "not strings" in error_of(path, "n")
    (tmp_path / "x.parquet").write_text("some text, not Parquet\n" * 20)
    assert "cannot read it as Parquet" in error_of(tmp_path / "x.parquet")
    (tmp_path / "empty.parquet").write_bytes(b"")
    assert "cannot read it as Parquet" in error_of(tmp_path / "empty.parquet")
    good = path.read_bytes()
    (tmp_path / "cut.parquet").write_bytes(good[: len(good) // 2])
    assert "cannot read" in error_of(tmp_path / "cut.parquet")


def test_empty_files_hold_no_documents(tmp_path: Path) -> None:
    """An empty text file, an empty JSON Lines file (or one of blank lines) and a Parquet table of no rows yield no
    document."""
    (tmp_path / "e.txt").write_bytes(b"")
    (tmp_path / "e.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n \n")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "e.parquet")
    for name in ("e.txt", "e.jsonl", "blank.jsonl", "e.parquet"):
        assert read(tmp_path / name) == [], name


def test_text_files_are_one_document(tmp_path: Path) -> None:
    """Any other suffix is text: the whole file one document, UTF-8, invalid bytes (at most 1 % of the characters)
    become U+FFFD."""
    (tmp_path / "a.py").write_bytes("line 1\nline ☃\n".encode() * 10 + b"\xff")
    assert read(tmp_path / "a.py") == ["line 1\nline ☃\n" * 10 + "\ufffd"]


def test_folder_order_and_hidden_entries(tmp_path: Path) -> None:
    """A folder's files, recursively, sorted by relative path as a string ("a.txt" < "a/b.jsonl" < "a_c.txt"),
    hidden files and hidden folders (the token cache .shardfusion-tokens, .git) left out; a file is its own list;
    a missing path raises FileNotFoundError naming --data."""
    for rel in ("b/z.txt", "a.txt", "a/b.jsonl", "a_c.txt", ".hidden.txt", ".shardfusion-tokens/x.tokens",
                ".git/config", "b/.env"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text('{"text": "j"}\n' if rel.endswith(".jsonl") else rel)
    assert [p.relative_to(tmp_path).as_posix() for p in data_files(tmp_path)] == [
        "a.txt", "a/b.jsonl", "a_c.txt", "b/z.txt"]
    assert data_files(tmp_path / "a.txt") == [tmp_path / "a.txt"]
    docs = [(p.name, t) for p, t in documents(data_files(tmp_path), "text", 10**6)]
    assert docs == [("a.txt", "a.txt"), ("b.jsonl", "j"), ("a_c.txt", "a_c.txt"), ("z.txt", "b/z.txt")]
    with pytest.raises(FileNotFoundError, match="--data"):
        data_files(tmp_path / "nowhere")


def test_max_bytes_cap(tmp_path: Path) -> None:
    """`documents` stops after the whole document whose UTF-8 bytes reach the cap (counted in bytes, not
    characters), across files; files after it are not opened."""
    write_jsonl(tmp_path / "1.jsonl", [{"text": "é" * 5}, {"text": "abcd"}, {"text": "xyz"}])  # 10, 4, 3 bytes
    (tmp_path / "2.jsonl").write_text("not json at all\n")
    files = data_files(tmp_path)
    texts = lambda cap: [t for _, t in documents(files, "text", cap)]  # noqa: E731
    assert texts(1) == ["é" * 5]
    assert texts(10) == ["é" * 5]
    assert texts(11) == ["é" * 5, "abcd"]
    assert texts(17) == ["é" * 5, "abcd", "xyz"]
    with pytest.raises(ValueError, match="2.jsonl line 1"):
        texts(18)


def compress(kind: str, data: bytes) -> bytes:
    """data compressed as a file of suffix `kind` holds it."""
    import bz2
    import gzip
    import lzma
    if kind == ".zst":
        return pytest.importorskip("zstandard").ZstdCompressor().compress(data)
    return {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}[kind](data)


@pytest.mark.parametrize("kind", [".gz", ".bz2", ".xz", ".zst"])
def test_compressed_files_are_decompressed(tmp_path: Path, kind: str) -> None:
    """A compressed text or JSON Lines file gives the documents of the file it holds, told by the suffix before the
    compression's (a.jsonl.gz is JSON Lines, is_structured); so does a folder of them, in path order."""
    records = [{"text": f"doc {i}: sé ☃"} for i in range(3)]
    plain_jsonl = write_jsonl(tmp_path / "plain.jsonl", records)
    (tmp_path / "plain.txt").write_text("line ☃\n" * 20, encoding="utf-8")
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / f"a.jsonl{kind}").write_bytes(compress(kind, plain_jsonl.read_bytes()))
    (folder / f"b.txt{kind}").write_bytes(compress(kind, (tmp_path / "plain.txt").read_bytes()))
    assert read(folder / f"a.jsonl{kind}") == read(plain_jsonl) == [r["text"] for r in records]
    assert read(folder / f"b.txt{kind}") == read(tmp_path / "plain.txt")
    assert is_structured(folder / f"a.jsonl{kind}") and not is_structured(folder / f"b.txt{kind}")
    docs = [text for _, text in documents(data_files(folder), "text", 10**6)]
    assert docs == [r["text"] for r in records] + ["line ☃\n" * 20]


def test_files_that_are_not_text_are_refused(tmp_path: Path) -> None:
    """A file whose first MiB (decompressed) holds a NUL byte, or more than 1 % of characters that are not UTF-8,
    is refused in one line naming --data and the file, as JSON Lines or text, compressed or not; a file inside a
    folder is named by its own path; 1 % passes; data that do not decompress are refused naming the compression;
    a compressed Parquet file is refused; with check_text=False (the standard library) a file is read as before."""
    import gzip
    import random
    (tmp_path / "random.bin").write_bytes(random.Random(0).randbytes(4096))
    assert "not text (a NUL byte at offset" in error_of(tmp_path / "random.bin")
    (tmp_path / "nul.txt").write_bytes(b"text\0more")
    assert "NUL byte at offset 4" in error_of(tmp_path / "nul.txt")
    (tmp_path / "x.tar.gz").write_bytes(gzip.compress(b"name" + b"\0" * 96 + b"x" * 400))
    assert "NUL byte at offset 4 after decompression" in error_of(tmp_path / "x.tar.gz")
    latin = "café à la crème ".encode("latin-1") * 20  # 3 of 16 characters are not UTF-8
    (tmp_path / "latin.txt").write_bytes(latin)
    assert "60 of the first 320 characters are not UTF-8, more than 1%" in error_of(tmp_path / "latin.txt")
    (tmp_path / "latin.jsonl").write_bytes(b'{"text": "' + latin + b'"}\n')
    assert "not UTF-8 text" in error_of(tmp_path / "latin.jsonl")
    (tmp_path / "one_percent.txt").write_bytes(b"x" * 99 + b"\xff")  # 1 of 100 characters: text
    assert read(tmp_path / "one_percent.txt") == ["x" * 99 + "\ufffd"]
    (tmp_path / "over.txt").write_bytes(b"x" * 98 + b"\xff")
    assert "1 of the first 99" in error_of(tmp_path / "over.txt")
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("fine text\n")
    (folder / "sub" / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    with pytest.raises(ValueError, match=rf"^--data {folder / 'sub' / 'image.png'}: not text \(a NUL byte"):
        list(documents(data_files(folder), "text", 10**6))
    (tmp_path / "bad.gz").write_bytes(b"plain text, not gzip")
    assert "cannot decompress it as gzip" in error_of(tmp_path / "bad.gz")
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n' * 50)[:30])
    assert "cannot decompress it as gzip" in error_of(tmp_path / "cut.jsonl.gz")
    (tmp_path / "t.parquet.gz").write_bytes(gzip.compress(b"PAR1"))
    assert "a compressed Parquet file" in error_of(tmp_path / "t.parquet.gz")
    assert list(file_documents(tmp_path / "latin.txt", "text", check_text=False)) == [latin.decode("utf-8", "replace")]


def test_zst_without_zstandard_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the zstandard package a .zst file is a one-line error naming the extra that installs it."""
    import sys
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard raises ImportError
    (tmp_path / "a.jsonl.zst").write_bytes(b"(\xb5/\xfd")
    message = error_of(tmp_path / "a.jsonl.zst")
    assert "needs the zstandard package (pip install 'shardfusion[data]')" in message, message


def save_dataset(path: Path, columns: dict) -> Path:
    """`columns` saved as a Hugging Face Dataset with `Dataset.save_to_disk` (built locally, nothing downloaded)."""
    hf = pytest.importorskip("datasets")
    hf.Dataset.from_dict(columns).save_to_disk(str(path))
    return path


def test_datasets_folder_reads_as_the_same_json_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder written by `Dataset.save_to_disk` is one source whose documents are those of the same texts written
    as JSON Lines: the text column in row order across several read batches (3 rows each here), a null row skipped
    (as in Parquet), an empty one dropped by `documents`, other columns ignored; the byte cap ends at the same
    document; --text-field reads another column."""
    from shardfusion.train import hf_datasets
    monkeypatch.setattr(hf_datasets, "BATCH_ROWS", 3)
    rows = [f"row {i}: é ☃ {'x' * i}\n" for i in range(10)]
    values = rows[:4] + [None, ""] + rows[4:]
    folder = save_dataset(tmp_path / "ds", {"id": list(range(12)), "text": values, "alt": [str(i) for i in range(12)]})
    lines = write_jsonl(tmp_path / "same.jsonl", [{"text": v} for v in values if v is not None])
    assert data_files(folder) == [folder] and is_structured(folder) and not is_structured(tmp_path)
    for cap in (1, 30, 100, 10**6):
        ours = [t for _, t in documents(data_files(folder), "text", cap)]
        assert ours == [t for _, t in documents([lines], "text", cap)], cap
    assert [t for _, t in documents([folder], "text", 10**6)] == rows
    size = sum(len(r.encode()) for r in rows)
    assert (text_bytes(folder, "text", 10**6), text_bytes(folder, "text", 50)) == (size, 50)
    assert read(folder, "alt") == [str(i) for i in range(12)]


def test_datasets_dict_needs_a_split(tmp_path: Path) -> None:
    """A folder written by `DatasetDict.save_to_disk`: --split names the split folder read; without --split, with an
    unknown split, --split on a Dataset or on other data, and a save_to_disk folder inside a folder of files are
    one-line errors naming the flag and (for a DatasetDict) its splits; a missing path stays FileNotFoundError."""
    hf = pytest.importorskip("datasets")
    root = tmp_path / "dict"
    hf.DatasetDict({"train": hf.Dataset.from_dict({"text": ["a", "b"]}),
                    "test": hf.Dataset.from_dict({"text": ["c"]})}).save_to_disk(str(root))
    assert data_files(root, "test") == [root / "test"]
    assert [t for _, t in documents(data_files(root, "train"), "text", 10**6)] == ["a", "b"]

    def refusal(root: Path, split: str | None) -> str:
        with pytest.raises(ValueError) as caught:
            data_files(root, split)
        assert "\n" not in str(caught.value), caught.value
        return str(caught.value)

    message = refusal(root, None)
    assert message.startswith(f"--data {root} is a DatasetDict") and "train, test" in message and "--split" in message
    message = refusal(root, "validation")
    assert message.startswith("--split validation") and "(it has: train, test)" in message, message
    one = save_dataset(tmp_path / "one", {"text": ["x"]})
    assert refusal(one, "train").startswith("--split train") and "drop --split" in refusal(one, "train")
    lines = write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    assert refusal(lines, "train").startswith("--split train") and "drop --split" in refusal(lines, "train")
    assert refusal(tmp_path, None) == (f"--data {tmp_path}: {one} is a folder written by save_to_disk; pass it as "
                                       f"--data itself (one dataset per run)")
    with pytest.raises(FileNotFoundError, match="--data"):
        data_files(tmp_path / "nowhere", "train")


def test_datasets_folder_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing column names the columns there are and --text-field; a column that is not text, a folder whose
    Arrow file is gone and one whose state.json is broken are one-line errors naming the folder; without the
    datasets package a save_to_disk folder is refused when listed (before any reading), naming the extra."""
    import sys
    folder = save_dataset(tmp_path / "ds", {"title": ["a"], "n": [1]})
    message = error_of(folder)
    assert "'text' column" in message and "title, n" in message and "--text-field" in message, message
    assert "holds Value('int64')" in error_of(folder, "n") and "not strings" in error_of(folder, "n")
    gone = save_dataset(tmp_path / "gone", {"text": ["a"]})
    next(gone.glob("*.arrow")).unlink()
    assert "load_from_disk cannot read it" in error_of(gone)
    from shardfusion.train.token_cache import cache_key
    from shardfusion.train.tokenizer import byte_tokenizer
    with pytest.raises(ValueError, match=f"^--data {gone}: cannot read data-00000-of-00001.arrow, which its "):
        cache_key([gone], byte_tokenizer(), "text", 10)
    broken = save_dataset(tmp_path / "broken", {"text": ["a"]})
    (broken / "state.json").write_text("{not json")
    with pytest.raises(ValueError) as caught:
        cache_key([broken], byte_tokenizer(), "text", 10)
    assert str(caught.value).startswith(f"--data {broken}: cannot read its state state.json"), caught.value
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    with pytest.raises(ValueError) as caught:
        data_files(folder)
    assert str(caught.value) == (f"--data {folder}: a folder written by Hugging Face datasets' save_to_disk; reading "
                                 f"it needs the datasets package (pip install 'shardfusion[data]')")
    assert "needs the datasets package (pip install 'shardfusion[data]')" in error_of(folder)
