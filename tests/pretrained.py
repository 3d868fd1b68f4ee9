"""A pretrained Hugging Face folder for the tests of `--init-from`, built here (never downloaded): a tiny Llama of
the byte vocabulary (256 ids, so the job's default data and tokenizer fit it and the folder needs no tokenizer files),
written by ``save_pretrained``, and the reference loss a single process computes with it on the job's batches."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


def save_tiny_llama(folder: Path, *, seed: int = 7, max_shard_size: str | None = None) -> nn.Module:
    """Write a tiny untied Llama (hidden 48, 3 layers, 4 heads, 2 key/value heads, positions 64, eager attention,
    initializer_range 0.2: far from the job's own initialization, so a run that ignored the folder would show it) to
    ``folder`` with ``save_pretrained`` (in several files when ``max_shard_size`` is given); returns the model."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(seed)  # not the job's seed: the job's own initialization would give other weights
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), **kwargs)
    return model


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy of a transformers causal LM on ``x``, ``y`` ((B, T) int64 each), in fp32,
    without gradients: the job's loss."""
    with torch.no_grad():
        logits = model(input_ids=x).logits  # (B, T, V)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def first_loss(folder: Path, *, world: int, batch_size: int, seq_len: int, data_bytes: int,
               ranks: int | None = None) -> float:
    """The first step's loss of a run started from ``folder`` on the default data: the folder's model loaded by
    transformers in this process, on the first micro-batch of each of the ``world`` data-parallel ranks (the job's
    samplers, seed 42), the mean over the ranks; ``ranks``: over data-parallel ranks 0 .. ranks - 1 only (DiLoCo
    logs its first replica's loss)."""
    import transformers

    from shardfusion.train.data import BatchSampler, load_corpus, split_corpus

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    train, val = split_corpus(load_corpus(None, data_bytes))
    samplers = [BatchSampler(train=train, val=val, batch_size=batch_size, seq_len=seq_len, seed=42, dp_rank=r,
                             dp_world=world) for r in range(ranks or world)]
    return float(sum(loss_of(model, *s.get_batch("train", 0, 0)) for s in samplers) / len(samplers))
