"""The reference GPT on its own, one process: shapes, tied weights, initial loss, generation."""

import dataclasses
import math

import pytest
import torch

from shardfusion.models import GPT, PRESETS, VOCAB_SIZE, Block, GPTConfig


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
