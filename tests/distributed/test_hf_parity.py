"""Hugging Face models sharded as a user would: built on the meta device, wrapped with ``units=None`` (their
``_no_split_modules`` decoder layers) and ``init_fn=model._init_weights``, then stream-loaded from the safetensors of
an eager model (``sf.load_safetensors``). Three AdamW steps on a global batch equal the single-process reference:
the same eager model, loaded from the same file, trained on the whole batch.

Runs one W=4 job (FSDP, and HSDP 2 x 2) per model family: a Llama with tied embeddings and grouped-query attention,
and a Qwen3-MoE (4 experts, top 2; ep 1, as transformers' MoE layers hold every expert).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run_distributed

pytest.importorskip("transformers")  # the [hf] extra, installed by `make test`

WORLD = 4
JOB_TIMEOUT_S = 240
STEPS, ROWS, SEQ, LR = 3, 8, 16, 1e-2
ADAM_EPS = 1e-6  # above the reduction-order noise of near-zero gradients, which Adam would otherwise amplify
LAYOUTS = {"fsdp": dict(sharding=4), "hsdp": dict(sharding=4, fsdp_outer_degree=2)}
RTOL, ATOL = 1e-5, 1e-6


def _config(family: str):
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=SEQ, attn_implementation="eager")
    if family == "llama":
        return tf.LlamaConfig(intermediate_size=64, tie_word_embeddings=True, **common)
    return tf.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                             decoder_sparse_step=1, tie_word_embeddings=False, **common)


def _model(family: str):
    import transformers as tf

    cls = tf.LlamaForCausalLM if family == "llama" else tf.Qwen3MoeForCausalLM
    return cls(_config(family))


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (ROWS, SEQ + 1), generator=g) for _ in range(STEPS)]


def _loss(model, rows: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=rows[:, :-1]).logits  # (B, T, V)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))


def _train(model, batches, part=lambda rows: rows):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    losses = []
    for rows in batches:
        loss = _loss(model, part(rows))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _job(family: str, path: str) -> dict:
    import torch.distributed as dist

    import shardfusion as sf

    from safetensors.torch import load_file

    out = {"rank": dist.get_rank()}
    batches = _batches()
    ref = _model(family)
    ref.load_state_dict(load_file(path), strict=False)  # a tied weight is stored once
    ref_losses = _train(ref, batches)
    ref_state = {k: v.detach().clone() for k, v in ref.named_parameters()}
    for name, kwargs in LAYOUTS.items():
        topo = sf.Topology(**kwargs)
        with torch.device("meta"):
            model = _model(family)
        model = sf.fully_shard(model, topo, init_fn=model._init_weights)
        sf.load_safetensors(model, path)
        r, n = topo.data_parallel_rank, topo.dp * topo.sharding
        losses = _train(model, batches, lambda rows: rows.chunk(n)[r])
        mean = [comm_mean(l, n) for l in losses]
        full = sf.full_state_dict(model)
        out[name] = {"units": [u.name for u in sf.get_units(model)],
                     "loss_err": max(abs(a - b.item()) for a, b in zip(mean, ref_losses)),
                     "param_err": {k: (full[k] - v).abs().max().item() / (v.abs().max().item() + 1e-12)
                                   for k, v in ref_state.items() if k in full},
                     "missing": sorted(set(ref_state) - set(full))}
    return out


def comm_mean(loss: torch.Tensor, n: int) -> float:
    """The global batch's mean loss from each data-parallel rank's mean over its equal share."""
    import torch.distributed as dist

    t = loss.clone()
    dist.all_reduce(t)
    return t.item() / n


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def job(request, tmp_path_factory):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    eager = _model(request.param)
    path = str(tmp_path_factory.mktemp(request.param) / "model.safetensors")
    save_file({k: v.contiguous() for k, v in eager.named_parameters()}, path)  # HF stores a tied weight once
    return request.param, run_distributed(_job, WORLD, request.param, path, timeout=JOB_TIMEOUT_S)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_units_are_the_decoder_layers(job, layout):
    _family, ranks = job
    for r in ranks:
        assert r[layout]["units"] == ["", "model.layers.0", "model.layers.1"], r[layout]["units"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_meta_built_stream_loaded_model_trains_at_parity(job, layout):
    family, ranks = job
    for r in ranks:
        got = r[layout]
        assert got["missing"] == [], got["missing"]
        assert got["loss_err"] <= 1e-5, f"{family} {layout} rank {r['rank']}: loss error {got['loss_err']}"
        worst = max(got["param_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-4, f"{family} {layout} rank {r['rank']}: worst parameter {worst}"
