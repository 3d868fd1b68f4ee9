"""The byte corpus, its split, the batch sampler (the global batch sliced by data-parallel rank, and the per-rank
order of older runs) and the context-parallel slice, one process."""

from pathlib import Path

import os
import sysconfig

import numpy as np
import pytest
import torch

from shardfusion.train.data import (DATA_ORDER_PER_RANK, VAL_FRACTION, BatchSampler, context_parallel_slice,
                                    context_parallel_span, corpus_size, load_corpus, min_corpus_bytes, split_corpus,
                                    python_files, split_sizes, stdlib_files)


def make_sampler(dp_rank: int = 0, dp_world: int = 4, seed: int = 0, batch_size: int = 4,
                 **fields) -> BatchSampler:
    data = torch.randint(0, 256, (10_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    train, val = split_corpus(data)
    return BatchSampler(train=train, val=val, batch_size=batch_size, seq_len=16, seed=seed, dp_rank=dp_rank,
                        dp_world=dp_world, **fields)


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


def _glob_definition(root: Path) -> tuple[Path, ...]:
    """The corpus's files as defined (pathlib's glob, filtered and sorted), against which the walk is checked."""
    skipped = {"site-packages", "dist-packages", "__pycache__"}
    files = [p for p in root.rglob("*.py") if p.is_file() and not skipped & set(p.relative_to(root).parts[:-1])]
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


def test_python_files_are_the_glob_of_the_definition(tmp_path: Path) -> None:
    """`python_files` (os.walk) lists what ``rglob("*.py")`` with the filter lists, in the same order: on a tree
    whose names sort differently folder by folder than as whole paths ("a-b/", "a.py", "a/"), with skipped folders
    at any depth, a folder named like a file, links to a folder (not entered) and to a file (kept), and on the
    standard library itself (the default corpus: its order is the data order of every run on it)."""
    for rel in ("a.py", "a/x.py", "a-b/y.py", "a/site-packages/no.py", "b/c/__pycache__/no.py", "b/c/d.py",
                "dist-packages/no.py", "z.txt", ".hidden.py", "b/c/deeper/e.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("pass\n")
    (tmp_path / "folder.py").mkdir()
    os.symlink(tmp_path / "b", tmp_path / "link_to_b")
    os.symlink(tmp_path / "a.py", tmp_path / "link.py")
    os.symlink(tmp_path / "missing.py", tmp_path / "broken.py")
    ours = python_files(tmp_path)
    assert ours == _glob_definition(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in ours] == [
        ".hidden.py", "a-b/y.py", "a.py", "a/x.py", "b/c/d.py", "b/c/deeper/e.py", "link.py"]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert python_files(stdlib) == _glob_definition(stdlib) == tuple(stdlib_files())


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


def test_dp_slices_tile_one_global_batch_at_every_world_size() -> None:
    # G = 8 windows; the reference is the whole batch one rank draws at dp_world 1
    for step, micro_step in ((0, 0), (5, 1)):
        x_ref, y_ref = make_sampler(dp_world=1, batch_size=8).get_batch("train", step, micro_step)  # (8, 16)
        assert x_ref.shape == (8, 16) and len({tuple(row) for row in x_ref.tolist()}) == 8
        for dp_world in (1, 2, 4):
            samplers = [make_sampler(dp_rank=r, dp_world=dp_world, batch_size=8 // dp_world) for r in range(dp_world)]
            slices = [s.get_batch("train", step, micro_step) for s in samplers]
            assert all(x.shape == (8 // dp_world, 16) for x, _ in slices)
            assert torch.equal(torch.cat([x for x, _ in slices]), x_ref), dp_world  # rows [r*B, (r+1)*B) in order
            assert torch.equal(torch.cat([y for _, y in slices]), y_ref), dp_world
            assert all(torch.equal(s.global_batch(step, micro_step)[0], x_ref) for s in samplers)


def test_per_rank_order_of_older_runs_is_kept() -> None:
    # DATA_ORDER_PER_RANK: the sampler of runs before the global order, written out here as it was: each rank draws
    # batch_size offsets from default_rng([seed, 0, step, micro_step, dp_rank])
    sampler = make_sampler(dp_rank=3, dp_world=4, seed=5, data_order=DATA_ORDER_PER_RANK)
    starts = np.random.default_rng([5, 0, 7, 1, 3]).integers(0, len(sampler.train) - 16, size=4)
    windows = sampler.train[torch.from_numpy(starts)[:, None] + torch.arange(17)].long()  # (4, 17)
    x, y = sampler.get_batch("train", 7, 1)
    assert torch.equal(x, windows[:, :-1]) and torch.equal(y, windows[:, 1:])
    # its global batch depends on the world size: G = 8 as 2 ranks x 4 and as 4 ranks x 2 differ
    def union(dp_world: int) -> torch.Tensor:
        return torch.cat([make_sampler(dp_rank=r, dp_world=dp_world, batch_size=8 // dp_world, seed=5,
                                       data_order=DATA_ORDER_PER_RANK).get_batch("train", 7, 1)[0]
                          for r in range(dp_world)])

    assert not torch.equal(union(2), union(4))
    with pytest.raises(ValueError, match=r"data_order must be one of \(1, 2\), got 3"):
        make_sampler(data_order=3)


def test_context_parallel_slice() -> None:
    x, y = make_sampler().get_batch("train", 2, 0)  # (4, 16)
    for cp in (1, 2, 4):
        parts = [context_parallel_slice(x, y, r, cp) for r in range(cp)]
        assert all(a.shape == b.shape == (4, 16 // cp) and a.is_contiguous() for a, b in parts)
        assert torch.equal(torch.cat([a for a, _ in parts], dim=1), x)  # contiguous chunks, in cp-rank order
        assert torch.equal(torch.cat([b for _, b in parts], dim=1), y)
    assert context_parallel_span(16, 1, 4) == (4, 8)
    assert torch.equal(context_parallel_slice(x, y, 1, 4)[0], x[:, 4:8])
    with pytest.raises(ValueError, match=r"sequence length 16 must be divisible by cp 3.*16 % 3 = 1"):
        context_parallel_slice(x, y, 0, 3)
    with pytest.raises(ValueError, match=r"cp_rank\(2\) must be in \[0, cp\(2\)\)"):
        context_parallel_slice(x, y, 2, 2)
    with pytest.raises(ValueError, match=r"cp must be >= 1, got 0"):
        context_parallel_span(16, 0, 0)
    with pytest.raises(ValueError, match=r"must both be \(B, T\), got \(4, 16\) and \(4, 15\)"):
        context_parallel_slice(x, y[:, 1:], 0, 2)


def test_val_batches_are_the_same_on_every_rank() -> None:
    batches = [make_sampler(dp_rank=r).get_batch("val", 5)[0] for r in range(4)]
    assert all(torch.equal(batches[0], b) for b in batches)
    shares = [list(make_sampler(dp_rank=r).val_indices(6)) for r in range(4)]
    assert shares == [[0, 4], [1, 5], [2, 6], [3, 7]]  # 6 rounded up to 8, equal counts


def test_data_file_and_folder(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"hello ")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_bytes(b"world" * 20 + b"\xff")  # an invalid byte in 101 characters: text
    assert bytes(load_corpus(tmp_path / "a.txt").tolist()) == b"hello "
    assert bytes(load_corpus(tmp_path).tolist()) == b"hello " + b"world" * 20 + b"\xff"
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
    (tmp_path / "sub" / "b.txt").write_bytes(b"world" * 20 + b"\xff")
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


def test_compressed_and_binary_files_in_the_byte_corpus(tmp_path: Path) -> None:
    """The byte corpus (--tokenizer bytes on text files) holds the decompressed bytes of .gz/.bz2/.xz files, and
    corpus_size counts them (up to the cap); a file that is not text, alone or inside a folder, is refused by both,
    in one line naming the file; the standard library is read unchecked (a few of its test files are not UTF-8)."""
    import bz2
    import gzip
    import lzma
    text = "text ☃ of the corpus\n".encode() * 50
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(text))
    (tmp_path / "b.txt.bz2").write_bytes(bz2.compress(text))
    (tmp_path / "c.txt.xz").write_bytes(lzma.compress(text))
    for max_bytes in (10**6, 1500, 10):
        expected = (text * 3)[:max_bytes]
        assert bytes(load_corpus(tmp_path, max_bytes).tolist()) == expected
        assert corpus_size(tmp_path, max_bytes) == len(expected)
    assert bytes(load_corpus(tmp_path / "a.txt.gz").tolist()) == text
    (tmp_path / "z" / "deep").mkdir(parents=True)
    (tmp_path / "z" / "deep" / "random.bin").write_bytes(bytes(range(256)) * 4)
    for read in (load_corpus, corpus_size):
        with pytest.raises(ValueError, match=rf"^--data {tmp_path / 'z' / 'deep' / 'random.bin'}: not text \(a NUL "
                                             rf"byte at offset 0\)[^\n]*$"):
            read(tmp_path)
        with pytest.raises(ValueError, match="random.bin: not text"):
            read(tmp_path / "z" / "deep" / "random.bin")
    assert corpus_size(tmp_path, 3 * len(text)) == 3 * len(text)  # a file past the cap is not read


def test_binary_file_past_the_first_window_is_refused_before_launch(tmp_path: Path) -> None:
    """check_run (the job's pre-launch check, on every rank under torchrun) reads the head of every --data file the
    run will read, not only as many bytes as one window needs: a binary file after enough text is refused."""
    from shardfusion.train.config import JobConfig, check_run, resolve
    (tmp_path / "a.txt").write_text("enough text for the windows\n" * 1000)
    (tmp_path / "b.dat").write_bytes(b"\x00\x01\x02" * 100)
    config = resolve(JobConfig.from_flat(preset="tiny", data=str(tmp_path)), device="cpu", world_size=2)
    with pytest.raises(ValueError, match=rf"^--data {tmp_path / 'b.dat'}: not text"):
        check_run(config, world="--nproc 2")
    (tmp_path / "b.dat").unlink()
    check_run(config, world="--nproc 2")
