"""What the training job's preflight does with the data flags, in this process: shared by the data tests."""

from __future__ import annotations

from shardfusion.train import data_config as dc
from shardfusion.train.config import JobConfig, ResolvedJob, TokenizerFacts, resolve


def prepare(config: JobConfig, saved: dict | None = None, progress: bool = False) -> ResolvedJob:
    """The tokenizer (trained with --train-tokenizer), the config resolved with it (one rank on cpu), the corpus
    tokenized and checked: `shardfusion.train.job.preflight`'s data steps."""
    tokenizer = dc.prepare_tokenizer(config.corpus, config.model, config.run.out, saved, progress=progress)
    job = resolve(config, device="cpu", world_size=1, saved=saved, tokenizer=TokenizerFacts.of(tokenizer))
    dc.prepare_corpus(job.corpus, job.model, tokenizer, progress=progress)
    return job
