"""Context parallel (``shardfusion.context_parallel``) composed with FSDP/HSDP: parity with one process.

Each sequence of the global batch is split over the cp ranks (contiguous chunks); the GPT's attention gathers K/V
over the ``context`` group, and fully_shard sums the parameters' gradients over cp in the replicate all-reduce. A
few AdamW steps with clipping in each layout are compared with one process training the whole sequences: losses
and norms at rtol 1e-5 / atol 1e-6, parameters at atol 1e-5 (as tests/distributed/test_tensor_parallel.py).
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from reference import assert_run_matches, token_batch, train_adamw

JOB_TIMEOUT_S = 240
STEPS = 3
SEQ = 16
GLOBAL_BATCH = 4
LR = 1e-3
MAX_NORM = 0.5
RTOL, ATOL, PARAM_ATOL = 1e-5, 1e-6, 1e-5  # losses and norms: reference.RTOL / ATOL


def _config(experts: int = 0):
    from shardfusion.models import GPTConfig
    return GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=SEQ, fused_qkv=False, n_experts=experts, top_k=1)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(2000 + step, GLOBAL_BATCH, SEQ)  # (GLOBAL_BATCH, SEQ) each


def reference() -> dict:
    from shardfusion.models import GPT
    torch.manual_seed(0)
    model = GPT(_config())

    def loss_fn(step):
        loss = model(*_batch(step))[1]
        loss.backward()
        return loss.detach()

    out = train_adamw(model, loss_fn, STEPS, LR, MAX_NORM)
    return {**out, "params": {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}}


def sharded(layouts: list[dict]) -> list[dict]:
    import torch.distributed as dist

    import shardfusion as sf
    from shardfusion.context_parallel import sequence_chunk
    from shardfusion.models import GPT, Block
    from shardfusion.models.gpt_parallel import parallelize

    results = []
    for layout in layouts:
        topo = sf.Topology(**layout)
        context = topo.get_group("context")
        torch.manual_seed(0)
        model = parallelize(GPT(_config(), context_group=context), topo.get_mesh("mp"))
        model = sf.fully_shard(model, topo, units=(Block,))
        dp_world, dp_rank = topo.dp * topo.sharding, topo.data_parallel_rank
        per_rank, chunks = GLOBAL_BATCH // dp_world, topo.sep * topo.cp

        def loss_fn(step):
            x, y = (sequence_chunk(t[dp_rank * per_rank:(dp_rank + 1) * per_rank], topo.context_rank, chunks)
                    for t in _batch(step))
            loss = model(x, y)[1]
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)  # every rank's chunk mean; ranks with equal chunks appear mp times
            return float(total) / topo.world_size

        with sf.comm.CommCounter() as counter:
            out = train_adamw(model, loss_fn, STEPS, LR, MAX_NORM)
        summary = counter.summary()["context_parallel"]
        results.append({**out, "params": sf.full_state_dict(model, buffers=False),
                        "context_bytes_per_step": summary["bytes"] / STEPS,
                        "context_count_per_step": summary["count"] / STEPS})
    return results


W4_LAYOUTS = [dict(cp=2, sharding=2), dict(cp=2, sharding=2, fsdp_outer_degree=2), dict(cp=2, mp=2, sharding=1)]


@pytest.fixture(scope="module")
def w4_results():
    return run_distributed(sharded, 4, W4_LAYOUTS, timeout=JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def whole_sequences():
    return reference()


@pytest.mark.parametrize("index", range(len(W4_LAYOUTS)), ids=["cp2-inner2", "cp2-outer2", "cp2-mp2"])
def test_context_parallel_parity_world4(w4_results, whole_sequences, index):
    for rank, results in enumerate(w4_results):
        assert_run_matches(results[index], whole_sequences, f"{W4_LAYOUTS[index]} rank {rank}", PARAM_ATOL)
    # per layer and step: an all-gather of K and of V (forward) and a reduce-scatter of each gradient (backward)
    assert w4_results[0][index]["context_count_per_step"] == 4 * 2


def test_sequence_not_divisible_is_an_error():
    from shardfusion.context_parallel import sequence_chunk
    with pytest.raises(ValueError, match="divisible by 3, got 16"):
        sequence_chunk(torch.zeros(2, 16), 0, 3)
