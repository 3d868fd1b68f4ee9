"""The byte corpus, its split and the per-rank batch sampler, one process."""

from pathlib import Path

import pytest
import torch

from shardfusion.train.data import (VAL_FRACTION, BatchSampler, corpus_size, load_corpus, min_corpus_bytes,
                              split_corpus, split_sizes, stdlib_files)


def make_sampler(dp_rank: int = 0, dp_world: int = 4, seed: int = 0) -> BatchSampler:
    data = torch.arange(10_000, dtype=torch.int64).remainder(251).to(torch.uint8)
    train, val = split_corpus(data)
    return BatchSampler(train=train, val=val, batch_size=4, seq_len=16, seed=seed, dp_rank=dp_rank,
                        dp_world=dp_world)


def test_stdlib_corpus_is_deterministic_and_capped() -> None:
    files = stdlib_files()
    assert files and all(f.suffix == ".py" for f in files)
    assert not any(part in ("site-packages", "dist-packages") for f in files for part in f.parts)
    a = load_corpus(max_bytes=100_000)
    b = load_corpus(max_bytes=100_000)
    assert a.dtype == torch.uint8 and len(a) == 100_000
    assert torch.equal(a, b)
    assert bytes(a[:200].tolist()) == files[0].read_bytes()[:200]
    assert corpus_size(max_bytes=100_000) == 100_000


def test_split_is_fixed() -> None:
    data = torch.arange(1000, dtype=torch.int64).remainder(256).to(torch.uint8)
    train, val = split_corpus(data)
    assert len(val) == int(1000 * VAL_FRACTION) and len(train) + len(val) == 1000
    assert torch.equal(val, data[-len(val):]) and torch.equal(train, data[: len(train)])


def test_batches_shapes_and_shift() -> None:
    x, y = make_sampler().get_batch("train", step=3, micro_step=1)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_ranks_get_distinct_batches() -> None:
    batches = [make_sampler(dp_rank=r).get_batch("train", 0, 0)[0] for r in range(4)]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.equal(batches[i], batches[j])
    a = make_sampler().get_batch("train", 0, 0)[0]
    assert not torch.equal(a, make_sampler().get_batch("train", 1, 0)[0])  # steps differ
    assert not torch.equal(a, make_sampler().get_batch("train", 0, 1)[0])  # micro-steps differ


def test_batches_are_reproducible() -> None:
    a = make_sampler(dp_rank=2).get_batch("train", 7, 1)
    b = make_sampler(dp_rank=2).get_batch("train", 7, 1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], make_sampler(dp_rank=2, seed=1).get_batch("train", 7, 1)[0])


def test_val_batches_are_the_same_on_every_rank() -> None:
    batches = [make_sampler(dp_rank=r).get_batch("val", 5)[0] for r in range(4)]
    assert all(torch.equal(batches[0], b) for b in batches)
    shares = [list(make_sampler(dp_rank=r).val_indices(6)) for r in range(4)]
    assert shares == [[0, 4], [1, 5], [2, 6], [3, 7]]  # 6 rounded up to 8, equal counts


def test_data_file_and_folder(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"hello ")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_bytes(b"world\xff")
    assert bytes(load_corpus(tmp_path / "a.txt").tolist()) == b"hello "
    assert bytes(load_corpus(tmp_path).tolist()) == b"hello world\xff"
    assert bytes(load_corpus(tmp_path, max_bytes=8).tolist()) == b"hello wo"
    with pytest.raises(FileNotFoundError):
        load_corpus(tmp_path / "missing")


def test_too_little_data_is_an_error() -> None:
    data = torch.zeros(100, dtype=torch.uint8)
    train, val = split_corpus(data)
    with pytest.raises(ValueError, match="seq_len"):
        BatchSampler(train=train, val=val, batch_size=1, seq_len=16, seed=0)


def test_corpus_size_without_reading(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"hello ")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_bytes(b"world\xff")
    for path, max_bytes in ((tmp_path / "a.txt", 100), (tmp_path, 100), (tmp_path, 8), (tmp_path, 1)):
        assert corpus_size(path, max_bytes) == len(load_corpus(path, max_bytes))
    (tmp_path / "empty").mkdir()
    assert corpus_size(tmp_path / "empty") == 0
    with pytest.raises(FileNotFoundError, match="--data"):
        corpus_size(tmp_path / "missing")


def test_unreadable_file_fails_the_size_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The launcher's pre-check reads each file's first byte, so an unreadable file is a usage error before any
    # worker starts. (The test runs as root, who reads any mode-000 file: the denial is simulated.)
    (tmp_path / "a.txt").write_bytes(b"hello")
    locked = tmp_path / "b.txt"
    locked.write_bytes(b"world")
    real_open = Path.open

    def deny(self: Path, *args, **kwargs):
        if self == locked:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", deny)
    with pytest.raises(OSError, match=r"^--data: cannot read .*b.txt: Permission denied$"):
        corpus_size(tmp_path)
    assert corpus_size(tmp_path, max_bytes=5) == 5  # a file past the cap is not read, so not checked


@pytest.mark.parametrize("n", [1, 2, 19, 20, 21, 999, 1000, 1001, 123_457])
def test_split_sizes_match_split_corpus(n: int) -> None:
    train, val = split_corpus(torch.zeros(n, dtype=torch.uint8))
    assert split_sizes(n) == (len(train), len(val))


@pytest.mark.parametrize("seq_len", [1, 8, 64, 128, 1000, 4097])
def test_min_corpus_bytes_is_the_least_that_samples(seq_len: int) -> None:
    def fits(n: int) -> bool:
        train, val = split_corpus(torch.zeros(n, dtype=torch.uint8))
        try:
            BatchSampler(train=train, val=val, batch_size=1, seq_len=seq_len, seed=0)
        except ValueError:
            return False
        return True

    n = min_corpus_bytes(seq_len)
    assert fits(n) and not fits(n - 1)
