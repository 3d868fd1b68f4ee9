"""--optimizer / --muon-lr of the training job in one process: the flags' checks, the schedule as a fraction of the
peak, which parameters Muon takes (GPT, GPT-MoE, a Hugging Face decoder), the lr of each optimizer per step, and the
refusal of a resume with another optimizer. The whole runs: tests/integration/test_train_muon.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardfusion.models.gpt import GPT, PRESETS, Block
from shardfusion.train.config import JobConfig, lr_at, lr_factor, parse_args
from shardfusion.train.optim import build_optimizers, muon_matrices, set_learning_rates
from shardfusion.train.resume import check_optimizer


def test_optimizer_flags() -> None:
    config = parse_args(["--optimizer", "muon", "--muon-lr", "0.05"])
    assert (config.optim.optimizer, config.optim.muon_lr) == ("muon", 0.05)
    assert (parse_args([]).optim.optimizer, parse_args([]).optim.muon_lr) == ("adamw", 0.05)
    with pytest.raises(ValueError, match=r"^--optimizer must be one of adamw, muon, got 'sgd'$"):
        JobConfig.from_flat(optimizer="sgd").validate()
    with pytest.raises(ValueError, match=r"^--muon-lr must be >= 0, got -0.1$"):
        JobConfig.from_flat(optimizer="muon", muon_lr=-0.1).validate()
    with pytest.raises(ValueError, match=r"^--optimizer muon with --mp 2: .* use --mp 1 or --optimizer adamw$"):
        JobConfig.from_flat(optimizer="muon", mp=2).validate()
    JobConfig.from_flat(optimizer="adamw", mp=2).validate()


def test_lr_factor_is_the_schedule_over_its_peak() -> None:
    config = JobConfig.from_flat(steps=50, warmup=5, lr=2e-3, min_lr=2e-4)
    factors = [lr_factor(config, s) for s in range(50)]
    assert factors == pytest.approx([lr_at(config, s) / 2e-3 for s in range(50)], rel=1e-12)
    assert factors[0] == pytest.approx(0.2) and factors[4] == pytest.approx(1.0)
    assert factors[-1] == pytest.approx(0.1, abs=2e-3)  # min_lr / lr, at the last step of the cosine
    flat = [lr_factor(config.replace(lr=0.0, min_lr=0.0), s) for s in (0, 4, 49)]
    assert flat[0] == pytest.approx(0.2) and flat[1] == pytest.approx(1.0) and flat[2] < 1e-2


def _chosen(model: torch.nn.Module, units: tuple[type, ...]) -> set[str]:
    chosen = muon_matrices(model, units)
    return {name for name, p in model.named_parameters() if chosen(name, p)}


def test_muon_takes_the_matrices_of_the_blocks() -> None:
    with torch.device("meta"):
        moe = GPT(dataclasses.replace(PRESETS["tiny"], n_experts=2, fused_qkv=False))
    names = _chosen(moe, (Block,))
    per_block = {"attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.proj.weight", "mlp.router.weight",
                 "mlp.experts.0.fc.weight", "mlp.experts.0.proj.weight", "mlp.experts.1.fc.weight",
                 "mlp.experts.1.proj.weight"}
    assert names == {f"blocks.{i}.{n}" for i in range(2) for n in per_block}
    # a 1-D fragment of the same name (element-sharded) is not Muon's
    assert not muon_matrices(moe, (Block,))("blocks.0.attn.q.weight", torch.empty(10, device="meta"))


def test_muon_takes_the_matrices_of_hf_decoder_layers() -> None:
    pytest.importorskip("transformers")
    from shardfusion.train import hf_models, job_model

    model = job_model.meta_model(JobConfig.from_flat(preset="tiny", hf_model="qwen3_moe"))
    names = _chosen(model, hf_models.unit_classes(model))
    per_layer = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate.weight"}  # the fused 3-D experts stay with AdamW
    assert names == {f"model.layers.{i}.{n}" for i in range(2) for n in per_layer}


def test_each_optimizer_gets_its_scaled_lr() -> None:
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(PRESETS["tiny"], n_layer=1))
    config = JobConfig.from_flat(optimizer="muon", steps=10, warmup=2, lr=4e-3, min_lr=4e-4, muon_lr=0.03)
    muon, adamw = build_optimizers(model, config.optim, muon_matrices(model, (Block,)))
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert {id(p) for p in muon.param_groups[0]["params"]}.isdisjoint(
        id(p) for g in adamw.param_groups for p in g["params"])
    assert len(muon.param_groups[0]["params"]) + sum(len(g["params"]) for g in adamw.param_groups) == len(
        list(model.parameters()))
    group = muon.param_groups[0]
    assert (group["momentum"], group["nesterov"], group["weight_decay"], group["adjust_lr_fn"]) == (
        0.95, True, config.optim.weight_decay, "original")
    for step in (0, 1, 5, 9):
        lr = set_learning_rates([muon, adamw], config.schedule, config.optim, step)
        assert lr == lr_at(config, step) and all(g["lr"] == lr for g in adamw.param_groups)
        assert group["lr"] == pytest.approx(0.03 * lr / 4e-3, rel=1e-12)


def test_a_resume_keeps_its_optimizer() -> None:
    check_optimizer("out", "muon", None)  # no checkpoint: nothing to check
    check_optimizer("out", "muon", {"optimizer": "muon"})
    check_optimizer("out", "adamw", {"lr": 3e-3})  # settings of a run before --optimizer: AdamW
    with pytest.raises(ValueError, match=r"^--optimizer muon: the checkpoint in --out out was written with "
                                         r"--optimizer adamw, .*resume with --optimizer adamw"):
        check_optimizer("out", "muon", {"lr": 3e-3})
    with pytest.raises(ValueError, match=r"written with --optimizer muon, .*resume with --optimizer muon"):
        check_optimizer("out", "adamw", {"optimizer": "muon"})
