"""Hugging Face models in the training job, one process (shardfusion/train/hf_models.py, job_model.py): the
presets' config fields from the job's flags, the units from `_no_split_modules`, the loss on the job's shifted
targets (not HF's `labels` loss), the MoE terms, the sampler, the parameter counts, the flags an HF model refuses
and the checks of an --init-from folder. Whole runs are in tests/integration/test_train_hf.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from shardfusion.train import hf_models  # noqa: E402
from shardfusion.train.config import JobConfig, check_pretrained, parse_args, resolve  # noqa: E402
from shardfusion.train.job_model import build, checked_meta_model, hf_config  # noqa: E402
from test_train_config import flag_error  # noqa: E402  (the one error line of a bad flag)

SHAPE = dict(n_layer=2, n_head=4, d_model=64, seq_len=32, n_experts=4, top_k=2, expert_hidden=None, dropout=0.0,
             aux_loss_coef=0.01)


@pytest.mark.timeout(60)
def test_preset_configs_from_flags() -> None:
    llama = hf_models.preset_config("llama", **SHAPE)
    assert isinstance(llama, transformers.LlamaConfig) and llama.architectures == ["LlamaForCausalLM"]
    assert (llama.vocab_size, llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads,
            llama.num_key_value_heads, llama.head_dim, llama.max_position_embeddings) == (256, 64, 2, 4, 2, 16, 32)
    assert llama.intermediate_size == hf_models.swiglu_width(4 * 64) == 176  # 2/3 of 256, rounded up to 8
    assert llama.tie_word_embeddings and llama.attention_dropout == 0.0 and llama.initializer_range == 0.02

    qwen = hf_models.preset_config("qwen3_moe", **{**SHAPE, "dropout": 0.1, "n_head": 3, "d_model": 48})
    assert qwen.architectures == ["Qwen3MoeForCausalLM"] and not qwen.tie_word_embeddings
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.num_attention_heads, qwen.num_key_value_heads,
            qwen.head_dim) == (4, 2, 3, 3, 16)  # an odd head count keeps every key/value head
    assert qwen.moe_intermediate_size == hf_models.swiglu_width(4 * 48 // 2) == 64
    assert qwen.norm_topk_prob and qwen.router_aux_loss_coef == 0.01 and qwen.attention_dropout == 0.1
    assert qwen.decoder_sparse_step == 1 and qwen.mlp_only_layers == []

    mixtral = hf_models.preset_config("mixtral", **{**SHAPE, "n_experts": 8, "top_k": 1, "expert_hidden": 40})
    assert mixtral.architectures == ["MixtralForCausalLM"]
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok, mixtral.intermediate_size) == (8, 1, 40)
    assert hf_models.moe_shape(mixtral) == (8, 1) and hf_models.moe_shape(llama) == (0, 0)
    assert hf_models.is_moe(mixtral) and hf_models.is_moe(qwen) and not hf_models.is_moe(llama)

    with pytest.raises(ValueError, match="--hf-model must be one of llama, qwen3_moe, mixtral, got 'gpt2'"):
        hf_models.preset_config("gpt2", **SHAPE)
    with pytest.raises(ValueError, match="--hf-model mixtral is a mixture of experts: it needs --experts >= 1"):
        hf_models.preset_config("mixtral", **{**SHAPE, "n_experts": 0})
    # the job's flags reach the preset through JobConfig (--preset tiny: 2 layers of 64)
    cfg = hf_config(JobConfig.from_flat(hf_model="qwen3_moe", preset="tiny", n_layer=3, seq_len=48, experts=6, top_k=3))
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.max_position_embeddings, cfg.num_experts,
            cfg.num_experts_per_tok) == (3, 64, 48, 6, 3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, layer", [("llama", "LlamaDecoderLayer"), ("qwen3_moe", "Qwen3MoeDecoderLayer"),
                                         ("mixtral", "MixtralDecoderLayer")])
def test_model_units_loss_and_sample(name: str, layer: str) -> None:
    config = hf_models.preset_config(name, **SHAPE)
    torch.manual_seed(0)
    model = hf_models.build_model(config)
    assert [cls.__name__ for cls in hf_models.unit_classes(model)] == [layer]
    assert model.config._attn_implementation == "sdpa"
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    inputs, targets = x[:, :-1], x[:, 1:]  # the job's batches: targets already shifted
    loss, aux, tokens = hf_models.losses(model, config, inputs, targets)
    logits = model(input_ids=inputs).logits
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1)))
    # HF's labels loss shifts once more: passing the shifted targets as labels would be another (wrong) loss
    assert not torch.allclose(model(input_ids=inputs, labels=targets).loss, loss)
    if name == "llama":
        assert aux.item() == 0.0 and tokens is None
        assert hf_models.num_parameters(model, config, active=True) == hf_models.num_parameters(model, config)
    else:
        hf_aux = model(input_ids=inputs, output_router_logits=True).aux_loss
        torch.testing.assert_close(aux, hf_aux)
        assert tokens.shape == (2, 4) and tokens.dtype == torch.long
        assert tokens.sum(dim=1).tolist() == [2 * 16 * 2] * 2  # every token to top_k = 2 experts, in each layer
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        total = hf_models.num_parameters(model, config)
        assert total == sum(p.numel() for p in model.parameters())
        assert hf_models.num_parameters(model, config, active=True) == total - experts // 2  # top 2 of 4
        loss.backward()
        assert model.model.layers[0].mlp.gate.weight.grad is not None  # the router learns from the cross-entropy
    out = hf_models.generate(model, inputs[:1], 5, seq_len=8, temperature=0.8, top_k=40,
                             generator=torch.Generator().manual_seed(2))
    again = hf_models.generate(model, inputs[:1], 5, seq_len=8, temperature=0.8, top_k=40,
                               generator=torch.Generator().manual_seed(2))
    assert out.shape == (1, 21) and torch.equal(out, again) and torch.equal(out[:, :16], inputs[:1])
    greedy = hf_models.generate(model, inputs[:1], 1, seq_len=8, temperature=0)
    assert greedy[0, -1] == model(input_ids=inputs[:1, -8:]).logits[0, -1].argmax()


@pytest.mark.timeout(60)
def test_job_model_of_an_hf_run() -> None:
    job = build(JobConfig.from_flat(hf_model="llama", preset="tiny", seed=3), None, torch.device("cpu"))
    again = build(JobConfig.from_flat(hf_model="llama", preset="tiny", seed=3), None, torch.device("cpu"))
    assert all(p.is_meta for p in job.module.parameters())  # fully_shard materializes it with job.init_fn
    for j in (job, again):  # what fully_shard's meta-device init does, in one process: the same values from --seed
        torch.manual_seed(3)
        j.module.to_empty(device="cpu")
        for m in j.module.modules():
            j.init_fn(m)
    assert all(torch.equal(a, b) for a, b in zip(job.module.parameters(), again.module.parameters()))
    assert job.tied == {"lm_head.weight"} and not job.moe and job.seq_len == 64
    fields = job.extra["hf_config"]
    assert fields["model_type"] == "llama" and fields["architectures"] == ["LlamaForCausalLM"]
    assert fields["dtype"] == "float32"
    rebuilt = hf_models.config_from_dict(json.loads(json.dumps(fields)))  # through a checkpoint's extra
    assert hf_models.config_dict(rebuilt) == fields
    assert hf_models.config_dict(hf_models.preset_config("llama", **{**SHAPE, "seq_len": 64})) == fields
    stored_bf16 = hf_models.preset_config("llama", **SHAPE)
    stored_bf16.dtype = torch.bfloat16  # a pretrained config may name the dtype its weights were saved in
    assert {p.dtype for p in hf_models.build_model(stored_bf16).parameters()} == {torch.float32}
    assert hf_models.config_dict(stored_bf16)["dtype"] == "float32"
    moe = build(JobConfig.from_flat(hf_model="mixtral", preset="tiny"), None, torch.device("cpu"))
    assert (moe.n_moe_layers, moe.n_experts, moe.top_k, moe.tied) == (2, 4, 2, frozenset())
    assert 0 < moe.num_active < moe.num_params


def test_hf_flags(capsys: pytest.CaptureFixture) -> None:
    assert flag_error(capsys, ["--ep", "2", "--hf-model", "qwen3_moe"]).startswith(
        "--ep 2 with --hf-model qwen3_moe: a Hugging Face model's experts run in its own modules")
    assert flag_error(capsys, ["--hf-model", "gpt2"]) == (
        "--hf-model must be one of llama, qwen3_moe, mixtral, got 'gpt2'")
    assert flag_error(capsys, ["--hf-model", "qwen3_moe", "--experts", "0"]).startswith(
        "--hf-model qwen3_moe is a mixture of experts: it needs --experts >= 1")
    assert flag_error(capsys, ["--init-from", "somewhere", "--d-model", "64"]) == (
        "--d-model does not apply to --init-from somewhere: the model's shape comes from its config.json; drop "
        "the flag")
    assert parse_args(["--hf-model", "llama", "--ep", "1"]).parallelism.ep == 1
    # ep resolves to 1 (the GPT-MoE's default at an even world size is 2), and the layout follows
    for flags in ({"hf_model": "qwen3_moe"}, {"init_from": "somewhere"}):
        resolved = resolve(JobConfig.from_flat(**flags), device="cpu", world_size=4)
        assert (resolved.ep, resolved.fsdp_outer_degree) == (1, 2)
    assert resolve(JobConfig(), device="cpu", world_size=4).ep == 2


def test_init_from_folder_checks(tmp_path: Path) -> None:
    def check(folder: Path, **fields) -> None:
        fields.setdefault("tokenizer", "bytes")  # the folders below hold no tokenizer
        check_pretrained(JobConfig.from_flat(init_from=str(folder), preset="tiny", **fields))

    with pytest.raises(ValueError, match="^--init-from .*: cannot read a Hugging Face config.json there"):
        check(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 300,
                                                      "max_position_embeddings": 64}))
    with pytest.raises(ValueError, match="holds no weights: neither model.safetensors nor "
                                         "model.safetensors.index.json"):
        check(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    check(tmp_path)
    with pytest.raises(ValueError, match=r"holds no tokenizer .* its model's vocabulary is 300, not the 256 bytes: "
                                         r"pass the tokenizer it was trained with \(--tokenizer PATH\)"):
        check(tmp_path, tokenizer=None)  # a pretrained vocabulary fed bytes would train nonsense
    check(tmp_path, hf_model="llama")
    with pytest.raises(ValueError, match="holds a llama model, not --hf-model mixtral; drop --hf-model"):
        check(tmp_path, hf_model="mixtral")
    with pytest.raises(ValueError, match="--seq-len 128 is longer than its max_position_embeddings 64; use "
                                         "--seq-len 64"):
        check(tmp_path, seq_len=128)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 100}))
    with pytest.raises(ValueError, match="its vocab_size is 100, but the job's tokens are the 256 byte values"):
        check(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 256}))
    with pytest.raises(ValueError, match="its config.json names no model_type"):
        check(tmp_path)


@pytest.mark.timeout(60)
def test_hf_model_and_init_from_together(tmp_path: Path) -> None:
    """--hf-model with --init-from: the folder decides the model, and --hf-model must name its model type (the
    pair's proof in the compatibility table, shardfusion/train/compat.py). The job builds the folder's model, of
    the folder's shape (not the preset's, which --hf-model alone would build), as --init-from alone does."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    both = JobConfig.from_flat(hf_model="llama", init_from=str(tmp_path), preset="tiny", seq_len=32)
    both.validate()
    check_pretrained(both)
    alone = JobConfig.from_flat(init_from=str(tmp_path), preset="tiny", seq_len=32)
    shapes = {n: p.shape for n, p in checked_meta_model(resolve(both, device="cpu", world_size=1)).named_parameters()}
    assert shapes == {n: p.shape for n, p in checked_meta_model(resolve(alone, device="cpu", world_size=1)).named_parameters()}
    assert shapes["model.embed_tokens.weight"] == (256, 48) and len([n for n in shapes if n.endswith(
        "input_layernorm.weight")]) == 3
    preset = {n: p.shape for n, p in checked_meta_model(resolve(JobConfig.from_flat(
        hf_model="llama", preset="tiny", seq_len=32), device="cpu", world_size=1)).named_parameters()}
    assert preset != shapes  # --hf-model alone: the preset's shape
    with pytest.raises(ValueError, match=r"holds a llama model, not --hf-model mixtral; drop --hf-model"):
        check_pretrained(JobConfig.from_flat(hf_model="mixtral", init_from=str(tmp_path), preset="tiny", seq_len=32))
