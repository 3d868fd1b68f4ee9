"""The reference GPT on its own, one process: shapes, tied weights, initial loss, generation; the GPT-MoE's shapes,
auxiliary outputs and initialisation. That an ep = 2 GPT-MoE is the ep = 1 one split in two (2 ranks) is in
tests/distributed/test_moe.py."""

import dataclasses
import math

import pytest
import torch

from shardfusion.models import GPT, PRESETS, VOCAB_SIZE, Block, GPTConfig
from shardfusion.moe import MoE, is_expert

TINY_MOE = dataclasses.replace(PRESETS["tiny"], n_experts=4, top_k=2)


@pytest.fixture
def tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(PRESETS["tiny"])


def test_forward_shapes(tiny: GPT) -> None:
    idx = torch.randint(0, VOCAB_SIZE, (3, 17))
    logits, loss = tiny(idx)
    assert logits.shape == (3, 17, VOCAB_SIZE)
    assert loss is None
    logits, loss = tiny(idx, torch.randint(0, VOCAB_SIZE, (3, 17)))
    assert loss is not None and loss.ndim == 0


def test_tied_embeddings_are_one_parameter(tiny: GPT) -> None:
    assert tiny.lm_head.weight is tiny.wte.weight
    names = [name for name, _ in tiny.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names
    untied = GPT(dataclasses.replace(PRESETS["tiny"], tie_embeddings=False))
    assert untied.lm_head.weight is not untied.wte.weight
    assert untied.num_parameters() == tiny.num_parameters() + VOCAB_SIZE * PRESETS["tiny"].d_model


def test_initial_loss_is_near_uniform(tiny: GPT) -> None:
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB_SIZE, (8, 64), generator=generator)
    targets = torch.randint(0, VOCAB_SIZE, (8, 64), generator=generator)
    _, loss = tiny(idx, targets)
    assert abs(loss.item() - math.log(VOCAB_SIZE)) < 0.1


def test_blocks_are_the_units(tiny: GPT) -> None:
    blocks = [m for m in tiny.modules() if isinstance(m, Block)]
    assert len(blocks) == PRESETS["tiny"].n_layer


def test_same_seed_same_model() -> None:
    torch.manual_seed(42)
    a = GPT(PRESETS["tiny"]).state_dict()
    torch.manual_seed(42)
    b = GPT(PRESETS["tiny"]).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_causal(tiny: GPT) -> None:
    idx = torch.randint(0, VOCAB_SIZE, (1, 20))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % VOCAB_SIZE
    a, _ = tiny(idx)
    b, _ = tiny(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_generate(tiny: GPT) -> None:
    prompt = torch.randint(0, VOCAB_SIZE, (2, 5))
    out = tiny.generate(prompt, 70, temperature=0.8, top_k=10, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 75) and out.dtype == torch.long
    assert torch.equal(out[:, :5], prompt)
    assert int(out.min()) >= 0 and int(out.max()) < VOCAB_SIZE
    greedy = tiny.generate(prompt, 3, temperature=0.0)
    assert torch.equal(greedy, tiny.generate(prompt, 3, temperature=0.0))


def test_too_long_input_is_an_error(tiny: GPT) -> None:
    with pytest.raises(ValueError, match="seq_len"):
        tiny(torch.zeros(1, PRESETS["tiny"].seq_len + 1, dtype=torch.long))


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(n_layer=1, n_head=3, d_model=64, seq_len=8)
    with pytest.raises(ValueError, match="n_layer"):
        GPTConfig(n_layer=0, n_head=1, d_model=64, seq_len=8)
    with pytest.raises(TypeError):
        GPTConfig(1, 1, 64, 8)  # keyword-only


def test_config_validation_moe() -> None:
    base = dict(n_layer=1, n_head=1, d_model=8, seq_len=8)
    with pytest.raises(ValueError, match=r"top_k\(3\) must be in \[1, n_experts\(2\)\]"):
        GPTConfig(**base, n_experts=2, top_k=3)
    with pytest.raises(ValueError, match=r"top_k\(0\)"):
        GPTConfig(**base, n_experts=2, top_k=0)
    with pytest.raises(ValueError, match=r"n_experts must be an int >= 0, got -1"):
        GPTConfig(**base, n_experts=-1)
    with pytest.raises(ValueError, match=r"expert_hidden must be a positive int or None, got 0"):
        GPTConfig(**base, n_experts=2, expert_hidden=0)
    GPTConfig(**base, n_experts=0, top_k=5)  # top_k is unused by a dense GPT
    assert GPTConfig(**base, n_experts=4, top_k=2).expert_hidden_size == 16  # 4 * d_model // top_k
    assert GPTConfig(**base, n_experts=4, expert_hidden=24).expert_hidden_size == 24


def test_moe_forward_backward() -> None:
    torch.manual_seed(0)
    model = GPT(TINY_MOE)
    assert all(isinstance(block.mlp, MoE) for block in model.blocks)
    assert [n for n, p in model.named_parameters() if is_expert(p)][:2] == [
        "blocks.0.mlp.experts.0.fc.weight", "blocks.0.mlp.experts.0.fc.bias"]
    per_expert = 2 * TINY_MOE.d_model * TINY_MOE.expert_hidden_size + TINY_MOE.expert_hidden_size + TINY_MOE.d_model
    dense = GPT(PRESETS["tiny"]).num_parameters()
    mlp = 8 * TINY_MOE.d_model ** 2 + 5 * TINY_MOE.d_model
    router = TINY_MOE.d_model * TINY_MOE.n_experts
    assert model.num_parameters() == dense + TINY_MOE.n_layer * (4 * per_expert + router - mlp)
    assert model.num_parameters(active=True) == dense + TINY_MOE.n_layer * (2 * per_expert + router - mlp)

    idx, targets = torch.randint(0, VOCAB_SIZE, (3, 17)), torch.randint(0, VOCAB_SIZE, (3, 17))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 17, VOCAB_SIZE) and loss.ndim == 0
    assert abs(loss.item() - math.log(VOCAB_SIZE)) < 0.2
    aux = model.aux_loss()
    assert aux.ndim == 0 and aux.dtype == torch.float32 and aux.requires_grad
    assert aux.item() == pytest.approx(1.0, abs=0.2)  # E * sum f * P is about 1 for a near-uniform router
    tokens = model.tokens_per_expert()
    assert tokens.shape == (TINY_MOE.n_layer, TINY_MOE.n_experts) and tokens.dtype == torch.long
    assert tokens.sum(dim=1).tolist() == [3 * 17 * TINY_MOE.top_k] * TINY_MOE.n_layer
    (loss + 0.01 * aux).backward()
    assert all(p.grad is not None for p in model.parameters())
    router = model.blocks[0].mlp.router.weight.grad
    assert router is not None and router.abs().sum() > 0

    dense_model = GPT(PRESETS["tiny"])
    dense_model(idx)
    assert dense_model.aux_loss().item() == 0.0 and dense_model.tokens_per_expert().shape == (0, 0)


def test_moe_init_is_reproducible_and_experts_skip_the_global_rng() -> None:
    torch.manual_seed(42)
    a = GPT(TINY_MOE)
    torch.manual_seed(42)
    b = GPT(TINY_MOE)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    # reset_parameters redraws the dense parameters from the global RNG but the experts from their own seeds.
    experts = {n: p.clone() for n, p in a.named_parameters() if is_expert(p)}
    dense = {n: p.clone() for n, p in a.named_parameters() if not is_expert(p)}
    torch.manual_seed(7)
    a.reset_parameters()
    assert all(torch.equal(p, experts[n]) for n, p in a.named_parameters() if is_expert(p))
    assert not torch.equal(a.blocks[0].mlp.router.weight, dense["blocks.0.mlp.router.weight"])
    proj = a.blocks[0].mlp.experts["1"].proj.weight
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * TINY_MOE.n_layer), rel=0.1)


@pytest.mark.parametrize("experts", [0, 4])
def test_split_qkv_is_the_fused_model(experts: int) -> None:
    """fused_qkv=False (the layout tensor parallel needs) draws the same weights from the same seed, the rows of the
    fused projection, and computes the same loss: runs of either layout are the same model."""
    config = GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=16, n_experts=experts)
    torch.manual_seed(3)
    fused = GPT(config)
    torch.manual_seed(3)
    split = GPT(dataclasses.replace(config, fused_qkv=False))
    for f, s in zip(fused.blocks, split.blocks):
        torch.testing.assert_close(f.attn.qkv.weight, torch.cat([s.attn.q.weight, s.attn.k.weight, s.attn.v.weight]),
                                   rtol=0, atol=0)
        torch.testing.assert_close(f.attn.proj.weight, s.attn.proj.weight, rtol=0, atol=0)
    x = torch.randint(0, VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fused(x, x)[1], split(x, x)[1], rtol=1e-6, atol=1e-6)


def test_tensor_parallel_shape_rules() -> None:
    from shardfusion.models.gpt_parallel import check_tensor_parallel

    config = GPTConfig(n_layer=1, n_head=4, d_model=32, seq_len=16, fused_qkv=False)
    check_tensor_parallel(config, 4)
    with pytest.raises(ValueError, match=r"mp\(3\) must divide n_head\(4\)"):
        check_tensor_parallel(config, 3)
    with pytest.raises(ValueError, match="fused_qkv=False"):
        check_tensor_parallel(dataclasses.replace(config, fused_qkv=True), 2)
