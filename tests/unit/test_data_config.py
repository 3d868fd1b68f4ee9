"""The data section of the training job (shardfusion.train.data_config): flag checks, which tokenizer a run gets,
the checks against a pretrained model and a resumed checkpoint, `prepare` and `load_splits` on both paths (plain
bytes, the token cache), the run's tokenizer copy, and the batch sampler over a numpy token stream."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from job_data import prepare  # noqa: E402
from shardfusion.train import data_config as dc  # noqa: E402
from shardfusion.train import tokenizer as tk  # noqa: E402
from shardfusion.train.config import JobConfig, resolve  # noqa: E402
from shardfusion.train.data import BatchSampler, min_corpus_bytes, split_corpus  # noqa: E402

DOCS = [f"record {i}: a small document about cats and hats, ☃\n" for i in range(80)]  # ~4 kB of text




@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bpe")
    tk.train_bpe(lambda: iter(DOCS), 300, folder)
    return folder


def _spec(config: JobConfig, resuming: bool = False) -> str:
    return dc.tokenizer_spec(config.corpus, config.model, config.run.out, resuming=resuming)


def _check_pretrained(config: JobConfig, tokenizer: tk.Tokenizer) -> str | None:
    return dc.check_pretrained_tokenizer(config.corpus, config.model, tokenizer)


def jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def pretrained(folder: Path, vocab_size: int, tokenizer_from: Path | None = None) -> str:
    """An --init-from folder: a config.json with vocab_size, and the tokenizer files of tokenizer_from if given."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab_size}))
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (folder / name).write_bytes((tokenizer_from / name).read_bytes())
    return str(folder)


@pytest.mark.parametrize("fields, words", [
    ({"train_tokenizer": 256}, ["--train-tokenizer 256 is too small", "257"]),
    ({"train_tokenizer": 300, "tokenizer": "bytes"}, ["--train-tokenizer 300 with --tokenizer bytes"]),
    ({"train_tokenizer": 300, "init_from": "m"}, ["--train-tokenizer with --init-from m"]),
    ({"text_field": ""}, ["--text-field"]),
    ({"data_bytes": 0}, ["--data-bytes must be >= 1"]),
    ({"split": "", "data": "d"}, ["--split must not be empty"]),
    ({"split": "train"}, ["--split train needs --data", "DatasetDict.save_to_disk"]),
])
def test_check_flags_refusals(fields: dict, words: list[str]) -> None:
    """check_flags refuses a BPE of < 257 ids, --train-tokenizer with --tokenizer or with --init-from, an empty
    --text-field and --data-bytes < 1, each in one line naming the flags; JobConfig.validate runs it."""
    config = JobConfig.from_flat(**fields)
    with pytest.raises(ValueError) as caught:
        (config).check_section("corpus")
    assert "\n" not in str(caught.value) and all(w in str(caught.value) for w in words), str(caught.value)
    (JobConfig.from_flat(train_tokenizer=257)).check_section("corpus")
    with pytest.raises(ValueError, match="--train-tokenizer 256"):
        JobConfig.from_flat(train_tokenizer=256).validate()


def test_tokenizer_spec_defaults(tmp_path: Path, bpe_folder: Path) -> None:
    """Without --tokenizer: bytes; an --init-from folder with a tokenizer gives that folder; one without a tokenizer
    gives bytes if its vocabulary is 256, else a one-line error naming --init-from and its vocabulary; a resumed run
    takes OUT/tokenizer; --tokenizer always wins."""
    assert _spec(JobConfig()) == "bytes"
    with_tok = pretrained(tmp_path / "with", 300, bpe_folder)
    assert _spec(JobConfig.from_flat(init_from=with_tok)) == with_tok
    assert _spec(JobConfig.from_flat(init_from=pretrained(tmp_path / "b256", 256))) == "bytes"
    big = pretrained(tmp_path / "v1000", 1000)
    with pytest.raises(ValueError) as caught:
        _spec(JobConfig.from_flat(init_from=big))
    assert "\n" not in str(caught.value) and f"--init-from {big}" in str(caught.value) and "1000" in str(caught.value)
    assert _spec(JobConfig.from_flat(init_from=big, tokenizer="bytes")) == "bytes"
    out = tmp_path / "out"
    tk.load(str(bpe_folder)).save(out / "tokenizer")
    assert _spec(JobConfig.from_flat(out=str(out)), resuming=True) == str(out / "tokenizer")
    assert _spec(JobConfig.from_flat(out=str(out)), resuming=False) == "bytes"


def test_check_vocabulary(tmp_path: Path, bpe_folder: Path) -> None:
    """A tokenizer with more ids than the pretrained model's vocab_size is refused, naming both numbers; as many
    or fewer ids pass; without --init-from nothing is checked."""
    t = tk.load(str(bpe_folder))
    small = pretrained(tmp_path / "small", t.vocab_size - 20)
    with pytest.raises(ValueError) as caught:
        dc.check_vocabulary(JobConfig.from_flat(init_from=small, tokenizer=str(bpe_folder)).model, t)
    message = str(caught.value)
    assert f"vocab_size {t.vocab_size - 20}" in message and f"has {t.vocab_size} ids" in message, message
    dc.check_vocabulary(JobConfig.from_flat(init_from=pretrained(tmp_path / "same", t.vocab_size)).model, t)
    dc.check_vocabulary(JobConfig.from_flat(init_from=pretrained(tmp_path / "larger", 4096)).model, t)
    dc.check_vocabulary(JobConfig().model, t)


def test_check_saved(bpe_folder: Path) -> None:
    """A resumed checkpoint of another tokenizer is refused, naming it and this run's; one without a fingerprint
    (an older byte-level run) resumes with bytes only; the same fingerprint resumes."""
    bpe, byte = tk.load(str(bpe_folder)), tk.byte_tokenizer()
    config = JobConfig.from_flat(out="runs/x")
    with pytest.raises(ValueError, match=r"^--tokenizer: the checkpoint in --out runs/x .* tokenizer bytes"):
        dc.check_saved(config.run.out, bpe, {"lr": 1.0})
    with pytest.raises(ValueError, match="trained with the tokenizer /old/tok, this run's is bytes"):
        dc.check_saved(config.run.out, byte, {"tokenizer": "/old/tok", "tokenizer_fingerprint": bpe.fingerprint})
    dc.check_saved(config.run.out, byte, {"lr": 1.0})
    dc.check_saved(config.run.out, bpe, {"tokenizer_fingerprint": bpe.fingerprint})
    dc.check_saved(config.run.out, bpe, None)


def test_prepare_plain_bytes_keeps_the_old_path(tmp_path: Path) -> None:
    """Text files with bytes: prepare resolves bytes (vocabulary 256) and creates no cache folder; load_splits gives
    uint8 tensors that are the file's bytes, split at the end."""
    data = tmp_path / "corpus.txt"
    data.write_text("".join(DOCS), encoding="utf-8")
    config = prepare(JobConfig.from_flat(data=str(data), seq_len=16), progress=False)
    assert (config.tokenizer, config.vocab_size, config.tokenizer_fingerprint) == ("bytes", 256, "bytes")
    assert dc.plain_bytes(config.corpus, config.model) and not (tmp_path / ".shardfusion-tokens").exists()
    train, val, info = dc.load_splits(config.corpus, config.model, tk.byte_tokenizer())
    assert train.dtype == val.dtype == torch.uint8
    assert bytes(torch.cat([train, val]).tolist()) == data.read_bytes()
    assert info == {"tokens": len(data.read_bytes()), "documents": None, "text_bytes": len(data.read_bytes()),
                    "cache": None}
    assert list(tmp_path.iterdir()) == [data]


def test_prepare_jsonl_with_a_tokenizer(tmp_path: Path, bpe_folder: Path) -> None:
    """JSON Lines with a BPE: prepare sets the tokenizer's vocabulary and fingerprint and builds the cache beside
    the data; load_splits' train + val is the packed stream (ids then eot per document, by the HF tokenizer)."""
    data = jsonl(tmp_path / "docs.jsonl", DOCS)
    t = tk.load(str(bpe_folder))
    config = prepare(JobConfig.from_flat(data=str(data), tokenizer=str(bpe_folder), seq_len=16), progress=False)
    assert (config.vocab_size, config.tokenizer_fingerprint) == (t.vocab_size, t.fingerprint)
    assert config.model_config().vocab_size == t.vocab_size
    train, val, info = dc.load_splits(config.corpus, config.model, t)
    expected = [i for d in DOCS for i in [*t.hf.encode(d, add_special_tokens=False), t.eot_id]]
    assert isinstance(train, np.ndarray) and np.concatenate([train, val]).tolist() == expected
    assert info["documents"] == len(DOCS) and Path(info["cache"]).parent == tmp_path / ".shardfusion-tokens"


def test_prepare_refuses_too_small_corpora(tmp_path: Path) -> None:
    """A corpus that tokenizes to fewer tokens than a window per split needs is refused, naming its tokens and
    --seq-len; a corpus of empty files is refused as holding no documents."""
    data = jsonl(tmp_path / "tiny.jsonl", ["abc", "de"])  # 4 + 3 byte tokens with the eots
    with pytest.raises(ValueError) as caught:
        prepare(JobConfig.from_flat(data=str(data), seq_len=16), progress=False)
    message = str(caught.value)
    assert "holds only 7 tokens (2 documents)" in message and f">= {min_corpus_bytes(16)} tokens" in message
    assert "--seq-len" in message and "\n" not in message
    (tmp_path / "empty").mkdir()
    jsonl(tmp_path / "empty" / "a.jsonl", [])
    (tmp_path / "empty" / "b.txt").write_text("")
    with pytest.raises(ValueError, match="holds no documents"):
        prepare(JobConfig.from_flat(data=str(tmp_path / "empty"), tokenizer="bytes", seq_len=16), progress=False)


def test_prepare_trains_a_tokenizer_once(tmp_path: Path, monkeypatch) -> None:
    """--train-tokenizer N trains a BPE of <= N ids into the cache folder and runs with it; a second prepare of the
    same corpus reuses it without training; a resume against another fingerprint is refused."""
    data = jsonl(tmp_path / "docs.jsonl", DOCS)
    first = prepare(JobConfig.from_flat(data=str(data), train_tokenizer=290, seq_len=16), progress=False)
    assert Path(first.tokenizer).parent == tmp_path / ".shardfusion-tokens" and 257 <= first.vocab_size <= 290
    monkeypatch.setattr(tk, "train_bpe", lambda *a, **k: pytest.fail("trained again"))
    again = prepare(JobConfig.from_flat(data=str(data), train_tokenizer=290, seq_len=16), progress=False)
    assert (again.tokenizer, again.tokenizer_fingerprint) == (first.tokenizer, first.tokenizer_fingerprint)
    with pytest.raises(ValueError, match="^--tokenizer: the checkpoint"):
        prepare(JobConfig.from_flat(data=str(data), train_tokenizer=290, seq_len=16, out=str(tmp_path / "o")),
                   saved={"tokenizer_fingerprint": "another"}, progress=False)


def test_save_run_tokenizer(tmp_path: Path, bpe_folder: Path) -> None:
    """Bytes write nothing; a BPE is copied to OUT/tokenizer (same fingerprint when loaded), kept as is on a second
    call, and another tokenizer moves it to OUT/tokenizer.earlier-1."""
    assert dc.save_run_tokenizer(tmp_path, tk.byte_tokenizer()) is None and not list(tmp_path.iterdir())
    bpe = tk.load(str(bpe_folder))
    folder = dc.save_run_tokenizer(tmp_path, bpe)
    assert folder == tmp_path / "tokenizer" and tk.load(str(folder)).fingerprint == bpe.fingerprint
    assert dc.save_run_tokenizer(tmp_path, bpe) == folder and not (tmp_path / "tokenizer.earlier-1").exists()
    other = tk.train_bpe(lambda: iter(DOCS[:10]), 270, tmp_path / "other")
    dc.save_run_tokenizer(tmp_path, other)
    assert tk.load(str(tmp_path / "tokenizer")).fingerprint == other.fingerprint
    assert tk.load(str(tmp_path / "tokenizer.earlier-1")).fingerprint == bpe.fingerprint


def test_batch_sampler_over_a_numpy_stream() -> None:
    """Over a uint16 numpy stream the sampler gives the same int64 windows as over a torch tensor of the same
    values and seed; each window is the stream sliced at its start (inputs) and one later (targets);
    val_bytes_per_token is 1.0 for bytes and the table's mean where every id has the same length."""
    values = np.arange(3000, dtype=np.uint16) * 7 % 5000  # distinct values: a window's first value is its start
    train_np, val_np = split_corpus(values)
    train_t, val_t = split_corpus(torch.from_numpy(values.astype(np.int64)))
    make = lambda train, val: BatchSampler(train=train, val=val, batch_size=3, seq_len=8, seed=5, dp_world=2)  # noqa
    over_np, over_t = make(train_np, val_np), make(train_t, val_t)
    for split, step in (("train", 0), ("train", 4), ("val", 1)):
        a, b = over_np.get_batch(split, step), over_t.get_batch(split, step)
        assert a[0].dtype == torch.int64 and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        source = train_np if split == "train" else val_np
        for row_in, row_out in zip(*a):
            start = int(np.flatnonzero(source == row_in[0].item())[0])
            assert row_in.tolist() == source[start:start + 8].tolist()
            assert row_out.tolist() == source[start + 1:start + 9].tolist()
    assert torch.equal(over_np.global_batch(2)[0], over_t.global_batch(2)[0])
    byte_stream = np.frombuffer("".join(DOCS).encode(), dtype=np.uint8)
    byte_sampler = make(*split_corpus(byte_stream))
    assert byte_sampler.val_bytes_per_token(tk.byte_tokenizer().token_bytes(), 4) == 1.0
    assert byte_sampler.val_bytes_per_token(np.full(256, 3), 4) == 3.0


def test_prepare_reads_compressed_data_and_refuses_binary(tmp_path: Path, bpe_folder: Path) -> None:
    """prepare (before launch) tokenizes a .jsonl.gz file as the JSON Lines inside it, the same stream as the plain
    file's, and refuses a folder holding a binary file with a one-line error naming that file."""
    import gzip
    (tmp_path / "plain").mkdir()
    plain = jsonl(tmp_path / "plain" / "docs.jsonl", DOCS)
    packed = tmp_path / "packed" / "docs.jsonl.gz"
    packed.parent.mkdir()
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    t = tk.load(str(bpe_folder))
    streams = []
    for data in (plain, packed):
        config = prepare(JobConfig.from_flat(data=str(data), tokenizer=str(bpe_folder), seq_len=16), progress=False)
        train, val, info = dc.load_splits(config.corpus, config.model, t)
        assert info["documents"] == len(DOCS)
        streams.append(np.concatenate([train, val]).tolist())
    assert streams[0] == streams[1]
    (tmp_path / "packed" / "weights.bin").write_bytes(bytes(range(256)))
    for tokenizer in (str(bpe_folder), "bytes"):
        with pytest.raises(ValueError, match=rf"^--data {tmp_path / 'packed' / 'weights.bin'}: not text[^\n]*$"):
            prepare(JobConfig.from_flat(data=str(tmp_path / "packed"), tokenizer=tokenizer, seq_len=16), progress=False)


@pytest.fixture(scope="module")
def other_folder(tmp_path_factory, bpe_folder: Path) -> Path:
    """A BPE of the same size as bpe_folder's, trained on other text: the same vocabulary size, other ids."""
    folder = tmp_path_factory.mktemp("other")
    other = tk.train_bpe(lambda: iter([f"zebras {i} jump ✓ over tall fences\n" for i in range(80)]), 300, folder)
    assert other.vocab_size == tk.load(str(bpe_folder)).vocab_size
    return folder


def test_tokenizer_that_contradicts_the_pretrained_one(tmp_path: Path, bpe_folder: Path, other_folder: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """--init-from DIR --tokenizer OTHER, OTHER of the same size with other ids, is refused in one line naming both
    sources and both ids fingerprints (prepare, before launch); with --tokenizer-override it is a one-line warning
    naming both; DIR's own tokenizer (the folder, its tokenizer.json, a copy), or a DIR without a tokenizer, passes;
    --tokenizer bytes contradicts a BPE folder but not the byte tokenizer an export of a byte-level run holds."""
    model = pretrained(tmp_path / "model", 300, bpe_folder)
    ours, theirs = tk.load(str(other_folder)), tk.load(str(bpe_folder))
    assert ours.ids_fingerprint != theirs.ids_fingerprint
    data = jsonl(tmp_path / "docs.jsonl", DOCS)
    config = JobConfig.from_flat(init_from=model, tokenizer=str(other_folder), data=str(data), seq_len=16)
    with pytest.raises(ValueError) as caught:
        prepare(config, progress=False)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"--tokenizer {other_folder} (ids fingerprint "
                                                      f"{ours.ids_fingerprint[:12]}, 300 ids)"), message
    assert f"--init-from {model} (ids fingerprint {theirs.ids_fingerprint[:12]})" in message, message
    assert "--tokenizer-override" in message, message
    override = config.replace(tokenizer_override=True)
    assert prepare(override, progress=False).tokenizer == str(other_folder)
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("shardfusion: warning: ")]
    assert len(warnings) == 1 and ours.ids_fingerprint[:12] in warnings[0], warnings
    assert theirs.ids_fingerprint[:12] in warnings[0] and f"--init-from {model}" in warnings[0], warnings
    theirs.save(tmp_path / "copy")
    for same in (str(bpe_folder), str(bpe_folder / "tokenizer.json"), str(tmp_path / "copy"), None):
        fields = {} if same is None else {"tokenizer": same}
        assert _check_pretrained(JobConfig.from_flat(init_from=model, **fields), tk.load(same or model)) is None
    bare = pretrained(tmp_path / "bare", 300)
    assert _check_pretrained(JobConfig.from_flat(init_from=bare, tokenizer=str(other_folder)), ours) is None
    with pytest.raises(ValueError, match=rf"^--tokenizer bytes \(ids fingerprint \w{{12}}, 256 ids\) maps"):
        _check_pretrained(JobConfig.from_flat(init_from=model, tokenizer="bytes"), tk.byte_tokenizer())
    exported = pretrained(tmp_path / "export", 256)
    tk.byte_tokenizer().save(exported)
    assert _check_pretrained(JobConfig.from_flat(init_from=exported, tokenizer="bytes"), tk.byte_tokenizer()) is None


def test_tokenizer_override_flag() -> None:
    """--tokenizer-override is a flag of the data section (off by default), documented in --help."""
    from shardfusion.train.config import build_parser, parse_args
    assert parse_args([]).corpus.tokenizer_override is False
    assert parse_args(["--tokenizer-override"]).corpus.tokenizer_override is True
    assert "--init-from folder" in " ".join(build_parser().format_help().split())


def test_prepare_a_datasets_folder_as_its_json_lines(tmp_path: Path, bpe_folder: Path) -> None:
    """--data a `Dataset.save_to_disk` folder, and a `DatasetDict` folder with --split: prepare and load_splits give
    the train and val tokens of the same texts written as JSON Lines, with a BPE and with bytes (the default, which
    packs the documents through the cache as for JSON Lines); --train-tokenizer trains on its documents; another
    --split reads another split; a DatasetDict
    without --split, an unknown split and a missing column are one-line errors naming the flag."""
    hf = pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    hf.Dataset.from_dict({"text": DOCS, "n": list(range(len(DOCS)))}).save_to_disk(str(folder))
    root = tmp_path / "dict"
    hf.DatasetDict({"train": hf.Dataset.from_dict({"text": DOCS}),
                    "test": hf.Dataset.from_dict({"text": DOCS[::-1]})}).save_to_disk(str(root))
    lines = jsonl(tmp_path / "docs.jsonl", DOCS)

    def splits(data: Path, tokenizer: str | None = None, **flags) -> tuple[list, list, dict]:
        job = prepare(JobConfig.from_flat(data=str(data), tokenizer=tokenizer, seq_len=16, **flags))
        train, val, info = dc.load_splits(job.corpus, job.model, tk.load(job.tokenizer))
        return np.asarray(train).tolist(), np.asarray(val).tolist(), info

    for tokenizer in (str(bpe_folder), None):
        want = splits(lines, tokenizer)
        for data, flags in ((folder, {}), (root, {"split": "train"})):
            got = splits(data, tokenizer, **flags)
            assert got[:2] == want[:2] and got[2]["documents"] == len(DOCS), (data, tokenizer)
            assert Path(got[2]["cache"]).parent == tmp_path / ".shardfusion-tokens"
    trained = prepare(JobConfig.from_flat(data=str(folder), train_tokenizer=290, seq_len=16))
    assert 257 <= trained.vocab_size <= 290 and Path(trained.tokenizer).name.startswith("bpe290-")
    reverse = splits(root, str(bpe_folder), split="test")
    assert reverse[:2] == splits(jsonl(tmp_path / "rev.jsonl", DOCS[::-1]), str(bpe_folder))[:2]

    for flags, words in (({"data": str(root)}, f"--data {root} is a DatasetDict with the splits train, test"),
                         ({"data": str(root), "split": "dev"}, "--split dev: "),
                         ({"data": str(folder), "text_field": "body"}, "no 'body' column (it has: text, n)")):
        with pytest.raises(ValueError) as caught:
            prepare(JobConfig.from_flat(seq_len=16, **flags))
        assert "\n" not in str(caught.value) and words in str(caught.value), caught.value


def test_split_is_a_resume_and_ft_shared_setting(tmp_path: Path) -> None:
    """--split decides the tokens, like --text-field: saved and compared on resume, and shared by fault-tolerant
    replica groups, though only when given (a run without it keeps the settings digest of runs before it)."""
    from shardfusion.train.config import FT_SHARED, RESUME_FIELDS
    assert "split" in RESUME_FIELDS and "split" in FT_SHARED and "text_field" in RESUME_FIELDS
    job = resolve(JobConfig.from_flat(data="d", split="train"), device="cpu", world_size=1)
    assert job.marked("ft_shared")["split"] == "train" and job.marked("resume")["split"] == "train"
    assert "split" not in resolve(JobConfig(), device="cpu", world_size=1).marked("ft_shared")
    assert dc.where(job.corpus) == "--data d --split train"
