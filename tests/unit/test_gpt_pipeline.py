"""Pipeline stages of a GPT (shardfusion/models/gpt_pipeline.py), in one process: the stages chained give the GPT's
logits bitwise, keep its parameter names, and bad splits are refused."""

from __future__ import annotations

import pytest
import torch

from shardfusion.models import GPT, GPTConfig
from shardfusion.models.gpt_pipeline import split_gpt, stage_layers


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_head=2, d_model=16, seq_len=8, tie_embeddings=False, **kw))


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_stages_chained_equal_the_gpt(num_stages: int) -> None:
    idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    want, _ = _gpt()(idx)
    stages = [split_gpt(_gpt(), s, num_stages) for s in range(num_stages)]
    x = idx
    for stage in stages:
        x = stage(x)
    assert torch.equal(x, want)
    names = [n for stage in stages for n, _ in stage.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in _gpt().named_parameters())  # each parameter once, the GPT's name


def test_moe_stages_keep_expert_names() -> None:
    stage = split_gpt(_gpt(n_experts=4, top_k=2), 1, 2)
    assert "blocks.2.mlp.experts.3.fc.weight" in dict(stage.named_parameters())


def test_stage_layers_split_evenly() -> None:
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    with pytest.raises(ValueError, match="the 4 layers do not split evenly into 3 pipeline stages"):
        stage_layers(4, 3)


def test_tied_gpt_last_stage_holds_a_copy_of_the_embedding() -> None:
    torch.manual_seed(0)
    tied = GPT(GPTConfig(n_layer=4, n_head=2, d_model=16, seq_len=8))
    idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    want, _ = tied(idx)
    first, last = split_gpt(tied, 0, 2), split_gpt(tied, 1, 2)
    assert first.tied_parameters == ("wte.weight",) and last.tied_parameters == ("lm_head.weight",)
    assert last.lm_head.weight is not first.wte.weight and torch.equal(last.lm_head.weight, first.wte.weight)
    assert torch.equal(last(first(idx)), want)
    assert split_gpt(tied, 0, 1).tied_parameters == ()  # one stage: the tie stays a tie


def test_bad_splits_refused() -> None:
    with pytest.raises(ValueError, match=r"stage_index must be in \[0, num_stages=2\), got 2"):
        split_gpt(_gpt(), 2, 2)
