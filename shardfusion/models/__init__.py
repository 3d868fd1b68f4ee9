"""Reference models for shardfusion."""

from shardfusion.models.gpt import GPT, PRESETS, VOCAB_SIZE, Block, GPTConfig

__all__ = ["GPT", "GPTConfig", "Block", "PRESETS", "VOCAB_SIZE"]
