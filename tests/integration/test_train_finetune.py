"""Fine-tuning a pretrained model with its own tokenizer, as whole runs of `python -m shardfusion.train` (gloo
workers). The pretrained folder is built here, never downloaded: a byte-level BPE of 512 ids trained with
`tokenizers` on a small JSON Lines corpus and a tiny Llama of that vocabulary saved with `save_pretrained`, the
tokenizer files beside it. The job fine-tunes it at W=4 HSDP 2 x 2 on the JSON Lines file: the step-0 loss and the
pretrained model's validation loss equal a single-process transformers forward on the same batches, the loss
falls, bits per byte follow from the losses and the validation text, and the export loads with
`AutoModelForCausalLM` / `AutoTokenizer` and generates. A run at W=2 sees the same global batch and resumes at W=4
in the same order, from the same token cache. `--train-tokenizer` keeps its tokenizer in OUT/tokenizer and
resumes with it; a resume with another tokenizer and bad data are one-line usage errors before any worker starts.
The readers, the cache and the checks one by one: tests/unit/test_documents.py, test_token_cache.py,
test_data_config.py."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from harness import TRAIN_TIMEOUT_S, run_command, run_train, train_usage_error  # noqa: E402
from job_data import prepare  # noqa: E402
from shardfusion.train import data_config as dc  # noqa: E402
from shardfusion.train import tokenizer as tk  # noqa: E402
from shardfusion.train.config import JobConfig  # noqa: E402
from shardfusion.train.data import BatchSampler  # noqa: E402
from shardfusion.train.metrics import read_metrics  # noqa: E402

VOCAB, SEQ_LEN, EVAL_BATCHES, STEPS = 512, 32, 4, 6
TOPICS = ("cats", "hats", "boats", "trees", "rivers", "clocks", "lamps", "roads")




def _documents() -> list[str]:
    """~190 kB of varied, deterministic text: enough tokens for both splits at seq_len 32."""
    docs = []
    for i in range(1500):
        a, b = TOPICS[i % 8], TOPICS[(i * 5 + 3) % 8]
        docs.append(f"Note {i}: the {a} near the {b} were counted {i * 7 % 101} times; "
                    f"nobody asked why the {b} ({i % 13} of them) outnumbered the {a}.")
    return docs


def _ok(result) -> str:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "my.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(_documents())))
    return path


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face folder as a team brings it: config, safetensors and the tokenizer files."""
    folder = tmp_path_factory.mktemp("pretrained")
    docs = _documents()
    tokenizer = tk.train_bpe(lambda: iter(docs[:500]), VOCAB, folder / "tok")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      eos_token_id=tokenizer.eot_id, bos_token_id=tokenizer.eot_id,
                                      initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(3)
    transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").save_pretrained(str(folder))
    tokenizer.save(folder)
    return folder


def _common(pretrained: Path, corpus: Path, cache: Path) -> list[str]:
    return ["--init-from", str(pretrained), "--data", str(corpus), "--data-cache", str(cache), "--seq-len",
            str(SEQ_LEN), "--eval-batches", str(EVAL_BATCHES), "--global-batch-size", "8", "--steps", str(STEPS),
            "--warmup", "0", "--lr", "3e-3", "--eval-every", "3", "--save-every", "3", "--no-progress"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def finetune(tmp_path_factory: pytest.TempPathFactory, pretrained: Path, corpus: Path, cache: Path) -> Path:
    out = tmp_path_factory.mktemp("ft")
    _ok(run_train([*_common(pretrained, corpus, cache), "--nproc", "4", "--fsdp-outer-degree", "2",
                   "--sample-tokens", "12", "--out", str(out)]))
    return out


def _samplers(pretrained: Path, corpus: Path, cache: Path, world: int) -> list[BatchSampler]:
    """The job's samplers of data-parallel ranks 0..world-1 over the cached stream (global batch 8, seed 42)."""
    config = prepare(JobConfig.from_flat(init_from=str(pretrained), data=str(corpus), data_cache=str(cache)),
                        progress=False)
    train, val, _ = dc.load_splits(config.corpus, config.model, tk.load(config.tokenizer))
    return [BatchSampler(train=train, val=val, batch_size=8 // world, seq_len=SEQ_LEN, seed=42, dp_rank=r,
                         dp_world=world) for r in range(world)]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def _val_loss(model: torch.nn.Module, samplers: list[BatchSampler]) -> float:
    """The job's validation loss: each rank's mean over its share, then the mean over ranks."""
    per_rank = [sum(_loss(model, *s.get_batch("val", i)) for i in s.val_indices(EVAL_BATCHES))
                / len(s.val_indices(EVAL_BATCHES)) for s in samplers]
    return float(sum(per_rank) / len(per_rank))


@pytest.mark.timeout(TRAIN_TIMEOUT_S + 60)
def test_finetune_matches_transformers_and_learns(finetune: Path, pretrained: Path, corpus: Path,
                                                  cache: Path) -> None:
    train, val = read_metrics(finetune / "metrics.jsonl")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1)) and [r["step"] for r in val] == [0, 3, 6]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(pretrained)).eval()
    samplers = _samplers(pretrained, corpus, cache, 4)
    first = sum(_loss(model, *s.get_batch("train", 0, 0)) for s in samplers) / 4
    assert float(first) == pytest.approx(train[0]["loss"], rel=1e-5, abs=1e-6)
    assert float(first) > math.log(VOCAB) - 1  # an untrained model of this vocabulary, not a byte model
    assert _val_loss(model, samplers) == pytest.approx(val[0]["val_loss"], rel=1e-5, abs=1e-6)
    assert val[-1]["val_loss"] < val[0]["val_loss"] - 0.3, val
    # bits per byte: nats per token over ln 2 x the validation text's bytes per target token
    token_bytes = tk.load(str(pretrained)).token_bytes()
    per_token = samplers[0].val_bytes_per_token(token_bytes, EVAL_BATCHES)
    assert per_token > 1.5  # the BPE merges: more than one byte per token
    for record in val:
        assert record["val_bpb"] == pytest.approx(record["val_loss"] / (math.log(2) * per_token), rel=1e-6)
    config = json.loads((finetune / "config.json").read_text())
    assert config["vocab_size"] == VOCAB and config["tokenizer"] == str(pretrained)
    assert config["corpus"]["documents"] == 1500 and config["corpus"]["cache"].startswith(str(cache))
    summary = json.loads((finetune / "summary.json").read_text())
    assert "outer2 x inner2" in summary["layout"]
    assert summary["final_val_bpb"] == val[-1]["val_bpb"] and summary["first_val_bpb"] == val[0]["val_bpb"]
    assert summary["sample"].startswith("Note ")  # a validation document's text, decoded with the tokenizer
    assert tk.load(str(finetune / "tokenizer")).fingerprint == tk.load(str(pretrained)).fingerprint


@pytest.mark.timeout(TRAIN_TIMEOUT_S + 60)
def test_export_loads_with_auto_classes_and_generates(finetune: Path, pretrained: Path, corpus: Path,
                                                      cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    result = run_command([sys.executable, "-m", "shardfusion.export", str(finetune), str(out)], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert model.config.vocab_size == VOCAB and len(tokenizer) == VOCAB
    text = "Note 7: the cats near the boats"
    assert tokenizer(text)["input_ids"] == tk.load(str(pretrained)).encode_batch([text])[0]
    _, val = read_metrics(finetune / "metrics.jsonl")
    assert _val_loss(model, _samplers(pretrained, corpus, cache, 4)) == pytest.approx(val[-1]["val_loss"],
                                                                                      rel=1e-5, abs=1e-6)
    prompt = tokenizer(text, return_tensors="pt")
    ids = model.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert ids.shape[1] > prompt["input_ids"].shape[1]
    assert tokenizer.decode(ids[0]).startswith(text)


@pytest.mark.timeout(3 * TRAIN_TIMEOUT_S)
def test_other_world_size_same_batches_and_resume(finetune: Path, pretrained: Path, corpus: Path, cache: Path,
                                                  tmp_path: Path) -> None:
    entries = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()}
    common = _common(pretrained, corpus, cache)
    first = _ok(run_train([*common, "--nproc", "2", "--stop-after", "3", "--sample-tokens", "0",
                           "--out", str(tmp_path)]))
    assert "tokenizing" not in first.lower(), first  # the cached stream, read as it is
    second = _ok(run_train([*common, "--nproc", "4", "--fsdp-outer-degree", "2", "--sample-tokens", "0",
                            "--out", str(tmp_path)]))
    assert "resuming at step 3 from" in second and "world size was 2, now 4" in second, second
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()} == entries  # reused, not rebuilt
    train, val = read_metrics(tmp_path / "metrics.jsonl")
    ref_train, ref_val = read_metrics(finetune / "metrics.jsonl")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for mine, ref in zip(train, ref_train):  # the same global batches; sums in another order
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-4), (mine, ref)
    # (the validation batches are drawn per rank, of the per-rank batch size: another set at another world size)
    assert [r["step"] for r in val] == [r["step"] for r in ref_val] == [0, 3, 6]


@pytest.mark.timeout(3 * TRAIN_TIMEOUT_S)
def test_trained_tokenizer_is_kept_and_resumed(corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out, cache = tmp_path / "run", tmp_path / "cache"
    args = ["--preset", "tiny", "--data", str(corpus), "--data-cache", str(cache), "--seq-len", str(SEQ_LEN),
            "--batch-size", "2", "--steps", "2", "--save-every", "1", "--eval-every", "1",
            "--eval-batches", "2", "--sample-tokens", "8", "--no-progress", "--out", str(out)]
    first = _ok(run_train([*args, "--train-tokenizer", "400", "--nproc", "2", "--stop-after", "1"]))
    assert "training a byte-level BPE tokenizer of 400 tokens" in first, first
    kept = tk.load(str(out / "tokenizer"))
    assert kept.vocab_size == 400 and json.loads((out / "config.json").read_text())["vocab_size"] == 400
    line = train_usage_error([*args, "--nproc", "2", "--tokenizer", "bytes"], capsys)
    assert line.startswith(f"--tokenizer: the checkpoint in --out {out} was trained with the tokenizer"), line
    assert "this run's is bytes" in line, line
    second = _ok(run_train([*args, "--train-tokenizer", "400", "--nproc", "2"]))
    assert "resuming at step 1 from" in second and "training a byte-level" not in second, second
    assert tk.load(str(out / "tokenizer")).fingerprint == kept.fingerprint


@pytest.mark.timeout(TRAIN_TIMEOUT_S)
def test_bad_data_is_a_usage_error_before_launch(pretrained: Path, corpus: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    base = ["--nproc", "2", "--steps", "1", "--seq-len", str(SEQ_LEN), "--data-cache", str(tmp_path / "c"),
            "--no-progress"]
    out = tmp_path / "out"
    line = train_usage_error([*base, "--data", str(corpus), "--text-field", "body", "--out", str(out)], capsys)
    assert "body" in line and str(corpus) in line, line
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    line = train_usage_error([*base, "--data", str(empty), "--out", str(out)], capsys)
    assert "holds no documents" in line, line
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    line = train_usage_error([*base, "--data", str(broken), "--out", str(out)], capsys)
    assert str(broken) in line, line
    bigger = tmp_path / "bigger"  # more ids than the pretrained model has embedding rows
    tk.train_bpe(lambda: iter(_documents()), 1000, bigger)
    line = train_usage_error([*base, "--init-from", str(pretrained), "--data", str(corpus), "--tokenizer",
                              str(bigger), "--out", str(out)], capsys)
    assert f"its model has vocab_size {VOCAB}" in line and "1000 ids" in line, line
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((pretrained / name).read_bytes())
    line = train_usage_error([*base, "--init-from", str(bare), "--data", str(corpus), "--out", str(out)], capsys)
    assert line.startswith(f"--init-from {bare} holds no tokenizer") and f"vocabulary is {VOCAB}" in line, line
    assert not out.exists()

