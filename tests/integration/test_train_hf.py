"""Hugging Face models in the training job, as whole runs of `python -m shardfusion.train` (gloo workers): a
tiny `--hf-model llama` trains on the default data (the standard library), resumes exactly after a stop and
exports to a folder that `transformers.AutoModelForCausalLM.from_pretrained` loads, with the run's final validation
loss; `--hf-model qwen3_moe` trains under HSDP with its expert figures; `--init-from` a folder written by
`save_pretrained` starts from those weights, with Muon too (the first loss equals a single-process forward of that
model on the same batches); `--ep 2` with an HF model, and an HF model without transformers, are usage errors
before any worker starts. The presets and the loss in one process: tests/unit/test_hf_models.py."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from harness import TRAIN_TIMEOUT_S, run_command, run_train, run_trains, train_usage_error  # noqa: E402
from shardfusion.checkpoint import read_all, read_meta  # noqa: E402
from shardfusion.checkpoint.export import export  # noqa: E402
from shardfusion.train.data import BatchSampler, load_corpus, split_corpus  # noqa: E402
from shardfusion.train.metrics import MOE_KEYS, TRAIN_KEYS, read_metrics  # noqa: E402

DATA_BYTES, SEQ_LEN, BATCH, EVAL_BATCHES = 300_000, 32, 4, 4
COMMON = ["--preset", "tiny", "--batch-size", str(BATCH), "--seq-len", str(SEQ_LEN), "--eval-batches",
          str(EVAL_BATCHES), "--data-bytes", str(DATA_BYTES), "--warmup", "2", "--no-progress"]
STEPS, SAVE_EVERY = 8, 4
LLAMA = [*COMMON, "--hf-model", "llama", "--nproc", "2", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
         "--eval-every", str(SAVE_EVERY), "--grad-accum", "2", "--dropout", "0.1", "--sample-tokens", "16"]


def _ok(result) -> str:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def _samplers(world: int) -> list[BatchSampler]:
    """The job's samplers of data-parallel ranks 0..world-1 (default data, seed 42)."""
    train, val = split_corpus(load_corpus(None, DATA_BYTES))
    return [BatchSampler(train=train, val=val, batch_size=BATCH, seq_len=SEQ_LEN, seed=42, dp_rank=r, dp_world=world)
            for r in range(world)]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """The uninterrupted run, and the first part of test_llama_exact_resume_after_stop's (--stop-after), started
    together (`harness.run_trains`): (the run's --out, the part's --out, the part's stdout)."""
    out, part = tmp_path_factory.mktemp("llama"), tmp_path_factory.mktemp("llama-part")
    whole, first = run_trains([*LLAMA, "--out", str(out)],
                              [*LLAMA, "--stop-after", str(SAVE_EVERY), "--out", str(part)])
    _ok(whole)
    return out, part, _ok(first)


@pytest.fixture(scope="module")
def llama_run(llama_runs: tuple[Path, Path, str]) -> Path:
    return llama_runs[0]


@pytest.mark.timeout(TRAIN_TIMEOUT_S + 30)
def test_llama_trains_on_the_default_data(llama_run: Path) -> None:
    train, val = read_metrics(llama_run / "metrics.jsonl")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1)) and [r["step"] for r in val] == [0, 4, 8]
    assert all(math.isfinite(r[k]) for r in train for k in TRAIN_KEYS) and not set(MOE_KEYS) & set(train[0])
    assert val[-1]["val_loss"] < val[0]["val_loss"] - 0.2, val  # from about ln 256 = 5.55
    summary = json.loads((llama_run / "summary.json").read_text())
    config = json.loads((llama_run / "config.json").read_text())
    assert config["hf_model"] == "llama" and config["model"]["model_type"] == "llama"
    assert config["model"]["architectures"] == ["LlamaForCausalLM"] and config["model"]["hidden_size"] == 64
    assert summary["experts"] is None and isinstance(summary["sample"], str)
    assert summary["layout"].startswith("world 2") and "ep1" in summary["layout"]
    assert summary["num_params"] == config["num_params"] > 0
    assert (llama_run / "loss.png").stat().st_size > 0


@pytest.mark.timeout(2 * TRAIN_TIMEOUT_S + 60)
def test_llama_exact_resume_after_stop(llama_runs: tuple[Path, Path, str]) -> None:
    llama_run, part, first = llama_runs  # the stopped run's folder: continued here
    assert "resuming" not in first
    second = _ok(run_train([*LLAMA, "--out", str(part)]))
    assert f"resuming at step {SAVE_EVERY} from" in second and "not an exact resume" not in second, second
    ours = read_all(str(part / "checkpoints" / f"step-{STEPS}"))
    theirs = read_all(str(llama_run / "checkpoints" / f"step-{STEPS}"))
    assert ours.keys() == theirs.keys() and any(k.endswith("/exp_avg_sq") for k in ours)
    assert "model/model.embed_tokens.weight" in ours and "model/lm_head.weight" not in ours  # tied: stored once
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    train, val = read_metrics(part / "metrics.jsonl")
    ref_train, ref_val = read_metrics(llama_run / "metrics.jsonl")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for mine, ref in zip(train, ref_train):
        assert (mine["loss"], mine["grad_norm"], mine["lr"]) == (ref["loss"], ref["grad_norm"], ref["lr"]), mine
    assert [(r["step"], r["val_loss"]) for r in val] == [(r["step"], r["val_loss"]) for r in ref_val]


@pytest.mark.timeout(TRAIN_TIMEOUT_S + 60)
def test_llama_export_loads_with_from_pretrained(llama_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "export"
    result = run_command([sys.executable, "-m", "shardfusion.export", str(llama_run), str(out)], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 256
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata()["format"] == "pt"
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # the tied weight once
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # the run's last validation loss, computed here as the job does (each rank's share, then the mean over ranks)
    per_rank = []
    for sampler in _samplers(2):
        indices = sampler.val_indices(EVAL_BATCHES)
        per_rank.append(sum(_loss(model, *sampler.get_batch("val", i)) for i in indices) / len(indices))
    _, val = read_metrics(llama_run / "metrics.jsonl")
    assert val[-1]["step"] == STEPS
    assert float(sum(per_rank) / 2) == pytest.approx(val[-1]["val_loss"], rel=1e-5, abs=1e-6)
    # a run on bytes: the checkpoint names no tokenizer folder, the export writes the byte-level one (id = byte)
    assert read_meta(str(llama_run / "checkpoints" / f"step-{STEPS}"))["extra"]["tokenizer"] == {
        "folder": None, "bytes": True}
    text = "Note 7: caf\u00e9"
    assert transformers.AutoTokenizer.from_pretrained(str(out))(text)["input_ids"] == list(text.encode())
    # and the export API, into a folder that exists: the same files
    export(str(llama_run), str(tmp_path / "again"))
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == config


@pytest.mark.timeout(TRAIN_TIMEOUT_S + 30)
def test_qwen3_moe_trains_under_hsdp(tmp_path: Path) -> None:
    steps = 2
    result = run_train([*COMMON, "--hf-model", "qwen3_moe", "--nproc", "4", "--steps", str(steps), "--eval-every",
                        "2", "--experts", "4", "--top-k", "2", "--sample-tokens", "8", "--out", str(tmp_path)])
    stdout = _ok(result)
    assert "aux loss" in stdout and "tokens/expert" in stdout
    train, val = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in train] == [1, 2] and [r["step"] for r in val] == [0, 2]
    assignments = 4 * BATCH * SEQ_LEN * 2 * 2  # 4 ranks, every token to top_k = 2 experts in each of 2 layers
    for record in train:
        assert set(MOE_KEYS) <= set(record) and sum(record["tokens_per_expert"]) == assignments
        assert len(record["tokens_per_expert"]) == 4 and 1.0 <= record["load_balance"] <= 2.0
        assert 1.0 < record["aux_loss"] < 4.0  # HF's loss: top_k = 2 when balanced, E = 4 at worst
        assert record["comm"]["replicate_all_reduce"]["count"] > 0 and record["comm"]["ep_all_to_all"]["count"] == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "outer2 x inner2" in summary["layout"] and summary["layout"].endswith("ep1")
    assert (summary["experts"]["n_experts"], summary["experts"]["top_k"], summary["experts"]["ep"]) == (4, 2, 1)
    assert 0 < summary["experts"]["num_active_params"] < summary["num_params"]


@pytest.mark.timeout(TRAIN_TIMEOUT_S + 60)
def test_init_from_pretrained_folder(tmp_path: Path) -> None:
    """A pretrained folder as save_pretrained writes it (a model of another shape than the preset's, untied, eager,
    its weights in several files under model.safetensors.index.json), trained with --optimizer muon: the weights
    load into Muon's owner layout (each decoder matrix whole on one rank), so the first loss and the first
    validation loss equal a single-process forward of the folder's model on the same batches; Muon holds the
    decoder layers' matrices, AdamW the rest. (AdamW from a folder: tests/integration/test_train_finetune.py.)"""
    from pretrained import save_tiny_llama

    folder = tmp_path / "pretrained"
    pretrained = save_tiny_llama(folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 1
    out = tmp_path / "run"
    stdout = _ok(run_train([*COMMON, "--init-from", str(folder), "--optimizer", "muon", "--nproc", "2", "--steps",
                            "1", "--warmup", "0", "--eval-every", "1", "--save-every", "1", "--sample-tokens", "0",
                            "--out", str(out)]))
    assert "--optimizer muon: Muon (lr 0.05) on 21 matrices of the blocks" in stdout, stdout[-3000:]
    train, val = read_metrics(out / "metrics.jsonl")
    # the reference: the pretrained model in this process, on the batches of both data-parallel ranks
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    samplers = _samplers(2)
    first = sum(_loss(model, *s.get_batch("train", 0, 0)) for s in samplers) / 2
    assert float(first) == pytest.approx(train[0]["loss"], rel=1e-5, abs=1e-6)
    assert float(first) > 5.7  # far from the ln 256 of a fresh model (initializer_range 0.02)
    before = sum(sum(_loss(model, *s.get_batch("val", i)) for i in s.val_indices(EVAL_BATCHES))
                 / len(s.val_indices(EVAL_BATCHES)) for s in samplers) / 2
    assert float(before) == pytest.approx(val[0]["val_loss"], rel=1e-5, abs=1e-6)
    assert val[-1]["val_loss"] < val[0]["val_loss"]
    run_config = json.loads((out / "config.json").read_text())
    assert run_config["model"]["hidden_size"] == 48 and run_config["model"]["num_hidden_layers"] == 3
    assert run_config["num_params"] == sum(p.numel() for p in pretrained.parameters())
    state = read_all(str(out / "checkpoints" / "step-1"))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.2.mlp.down_proj.weight"):
        assert f"optim/{name}/momentum_buffer" in state and f"optim/{name}/exp_avg" not in state, name
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert f"optim/{name}/exp_avg" in state and f"optim/{name}/momentum_buffer" not in state, name


@pytest.mark.timeout(TRAIN_TIMEOUT_S)
def test_hf_usage_errors_before_launch(tmp_path: Path, capsys: pytest.CaptureFixture,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process (`harness.train_usage_error`): exit status 2 and one line before any worker starts."""
    out = tmp_path / "run"
    line = train_usage_error([*COMMON, "--ep", "2", "--hf-model", "qwen3_moe", "--nproc", "2", "--out", str(out)],
                             capsys)
    assert line.startswith("--ep 2 with --hf-model qwen3_moe: ") and "ep must be 1" in line, line
    # without transformers (hidden from this process): the flag, and how to install it
    monkeypatch.setitem(sys.modules, "transformers", None)
    line = train_usage_error([*COMMON, "--hf-model", "llama", "--nproc", "2", "--out", str(out)], capsys)
    assert line.startswith("--hf-model llama needs the transformers package (pip install 'shardfusion[hf]')"), line
    assert not out.exists()
