"""Tensor parallel (torch's DTensor engine over ``topo.get_mesh("mp")``) composed with FSDP/HSDP: parity with one
process, the clip norm, full state dicts.

The reference GPT (dense, ``fused_qkv=False``) is split by ``shardfusion.models.gpt_parallel.parallelize`` (q, k, v
and fc column-wise, the output projections row-wise) and then sharded by ``fully_shard``. Every layout trains the
same global batch for a few AdamW steps with clipping by global norm; each step's global loss, the norm before
clipping, and the final parameters (``full_state_dict``, global shapes) are compared with one process training the
unsplit model on the global batch: rtol 1e-5 / atol 1e-6 (fp32; the row-wise all-reduce sums the mp partial products
in another order than one matmul does, the only rounding difference).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness import run_distributed
from reference import assert_run_matches, rank_loss_fn, rows_of, sliced_loss_fn, token_batch, train_adamw

JOB_TIMEOUT_S = 240
STEPS = 3
SEQ = 16
GLOBAL_BATCH = 8
MAX_NORM = 0.5  # below the measured norms (~1-2), so clipping is active every step
RTOL, ATOL = 1e-5, 1e-6  # losses and norms
PARAM_ATOL = 1e-5  # parameters: AdamW's m / sqrt(v) magnifies rounding where a gradient is near 0
LR = 1e-3


def _config(experts: int = 0):
    from shardfusion.models import GPTConfig
    return GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=SEQ, fused_qkv=False, n_experts=experts, top_k=1,
                     tie_embeddings=True)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: (GLOBAL_BATCH, SEQ) inputs and targets, int64."""
    return token_batch(1000 + step, GLOBAL_BATCH, SEQ)


def _slice(step: int, dp_world: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank ``dp_rank``'s rows of the global batch of ``step``."""
    return rows_of(_batch(step), dp_world, dp_rank)


def reference(experts: int = 0, dp_world: int = 1) -> dict:
    """One process, the whole model: each step the mean of the losses of the ``dp_world`` slices of the global batch
    (for a dense model the same as the loss of the whole batch; a MoE routes each slice by itself, as each rank
    does)."""
    from shardfusion.models import GPT
    torch.manual_seed(0)
    model = GPT(_config(experts))

    loss_fn = sliced_loss_fn(model, _slice, dp_world)
    out = train_adamw(model, loss_fn, STEPS, LR, MAX_NORM)
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return out


def sharded(layouts: list[dict]) -> list[dict]:
    """One result per layout: ``{"losses", "norms", "params" (full_state_dict, on every rank)}``."""
    import shardfusion as sf
    from shardfusion.models import GPT, Block
    from shardfusion.models.gpt_parallel import parallelize

    results = []
    for layout in layouts:
        topo = sf.Topology(**{k: v for k, v in layout.items() if k != "wrap"})
        torch.manual_seed(0)
        model = GPT(_config(4 if topo.ep > 1 else 0), ep_group=topo.get_group("ep") if topo.ep > 1 else None)
        parallelize(model, topo.get_mesh("mp"))
        model = sf.fully_shard(model, topo, units=(Block,), **layout.get("wrap", {}))
        out = train_adamw(model, rank_loss_fn(model, _slice, topo), STEPS, LR, MAX_NORM)
        out["params"] = sf.full_state_dict(model, buffers=False)
        out["layout"] = layout
        choice = sf.reshard_choice(model)
        out["kept"] = None if choice is None else choice.kept
        results.append(out)
    return results


def _compare(got: dict, want: dict) -> None:
    assert_run_matches(got, want, str(got["layout"]), PARAM_ATOL)


W4_LAYOUTS = [dict(mp=2, sharding=2), dict(mp=2, sharding=2, fsdp_outer_degree=2),
              # the blocks' DTensor views kept gathered from forward to backward: reshard_policy="auto" with a budget
              # that keeps both blocks (the policy's choice itself: tests/distributed/test_reshard_auto_ranks.py)
              dict(mp=2, sharding=2, wrap={"reshard_policy": "auto", "memory_budget": 1 << 40})]


@pytest.fixture(scope="module")
def w4_results():
    return run_distributed(sharded, 4, W4_LAYOUTS, timeout=JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def dense_reference():
    return reference(dp_world=2)


W8_LAYOUTS = [dict(mp=2, sharding=4, fsdp_outer_degree=2), dict(mp=2, sharding=4, ep=2)]


@pytest.fixture(scope="module")
def w8_results():
    return run_distributed(sharded, 8, W8_LAYOUTS, timeout=JOB_TIMEOUT_S)


@pytest.mark.parametrize("index", range(len(W8_LAYOUTS)), ids=["mp2-outer2-inner2", "mp2-ep2-moe"])
def test_tensor_parallel_parity_world8(w8_results, index):
    want = reference(experts=4 if W8_LAYOUTS[index].get("ep", 1) > 1 else 0, dp_world=4)
    print(W8_LAYOUTS[index], max_errors(w8_results[0][index], want))
    for rank in range(8):
        _compare(w8_results[rank][index], want)


@pytest.mark.parametrize("index", range(len(W4_LAYOUTS)), ids=["mp2-inner2", "mp2-outer2", "mp2-inner2-auto"])
def test_tensor_parallel_parity_world4(w4_results, dense_reference, index):
    print(W4_LAYOUTS[index], max_errors(w4_results[0][index], dense_reference))
    for rank in range(4):
        _compare(w4_results[rank][index], dense_reference)
        auto = "wrap" in W4_LAYOUTS[index]
        assert w4_results[rank][index]["kept"] == (("blocks.0", "blocks.1") if auto else None)


def test_parameters_are_dtensors_while_unsharded():
    run_distributed(_check_views, 2, timeout=JOB_TIMEOUT_S)


def _check_views() -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import shardfusion as sf
    from shardfusion.models import GPT, Block
    from shardfusion.models.gpt_parallel import parallelize

    topo = sf.Topology(mp=2, sharding=1)
    torch.manual_seed(0)
    model = parallelize(GPT(_config()), topo.get_mesh("mp"))
    model = sf.fully_shard(model, topo, units=(Block,))
    seen = {}

    def record(module, args):
        for name in ("weight", "bias"):
            p = getattr(module, name)
            seen[(id(module), name)] = (type(p), tuple(p.placements) if isinstance(p, DTensor) else None,
                                        tuple(p.shape), tuple(p.to_local().shape) if isinstance(p, DTensor) else None)

    attn = model.blocks[0].attn
    for m in (attn.q, attn.proj):
        m.register_forward_pre_hook(record)
    x, y = _batch(0)
    model(x, y)[1].backward()
    q_w = seen[(id(attn.q), "weight")]
    assert q_w[0] is not torch.Tensor and issubclass(q_w[0], DTensor), q_w
    assert q_w[1] == (Shard(0),) and q_w[2] == (32, 32) and q_w[3] == (16, 32), q_w
    proj_w, proj_b = seen[(id(attn.proj), "weight")], seen[(id(attn.proj), "bias")]
    assert proj_w[1] == (Shard(1),) and proj_w[3] == (32, 16), proj_w
    assert proj_b[1] == (Replicate(),) and proj_b[3] == (32,), proj_b
    # Between steps the modules hold fragments of this rank's piece (16 x 32 of q.weight, sharding 1: whole rows,
    # here all of them).
    frags = dict(model.named_parameters())
    assert frags["blocks.0.attn.q.weight"].shape == (16, 32)


def max_errors(got: dict, want: dict) -> dict:
    """Largest absolute differences (losses, norms, parameters): the figures docs/tensor-parallel.md reports."""
    return {"loss": max(abs(a - b) for a, b in zip(got["losses"], want["losses"])),
            "norm": max(abs(a - b) for a, b in zip(got["norms"], want["norms"])),
            "param": max(float((got["params"][n] - v).abs().max()) for n, v in want["params"].items())}


def _build(layout: dict, experts: int = 0):
    """The GPT of ``layout`` (split over mp when mp > 1; a GPT-MoE over the ep group with ``experts``), sharded,
    and an AdamW over its fragments."""
    import shardfusion as sf
    from shardfusion.models import GPT, Block
    from shardfusion.models.gpt_parallel import parallelize

    topo = sf.Topology(**layout)
    torch.manual_seed(0)
    model = GPT(_config(experts), ep_group=topo.get_group("ep") if experts else None)
    model = sf.fully_shard(parallelize(model, topo.get_mesh("mp")), topo, units=(Block,))
    return topo, model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _step(topo, model, opt, step: int) -> float:
    import torch.distributed as dist

    import shardfusion as sf
    dp_world = topo.dp * topo.sharding
    loss = model(*_slice(step, dp_world, topo.data_parallel_rank))[1]
    loss.backward()
    sf.clip_grad_norm_(model, MAX_NORM)
    opt.step()
    opt.zero_grad(set_to_none=True)
    t = loss.detach().clone()
    dist.all_reduce(t, group=topo.get_data_parallel_group())
    return float(t) / dp_world


def checkpoint_round_trip(root: str) -> dict:
    """A GPT-MoE: save at mp 2 x ep 2, load at mp 1 x ep 2, save there, load at mp 2 x outer 2 (ep 1); the loss of
    the step after each load and the full state dicts, against the run that never stopped."""
    import shardfusion as sf
    out = {}
    topo, model, opt = _build(dict(mp=2, sharding=2, ep=2), experts=4)
    for step in range(2):
        _step(topo, model, opt, step)
    sf.checkpoint.save(model, opt, f"{root}/mp2")
    out["saved"] = sf.full_state_dict(model, buffers=False)
    out["uninterrupted"] = [_step(topo, model, opt, step) for step in (2, 3)]
    topo, model, opt = _build(dict(mp=1, sharding=4, ep=2), experts=4)
    sf.checkpoint.load(model, opt, f"{root}/mp2")
    out["loaded_mp1"] = sf.full_state_dict(model, buffers=False)
    out["resumed_mp1"] = [_step(topo, model, opt, 2)]
    sf.checkpoint.save(model, opt, f"{root}/mp1")
    topo, model, opt = _build(dict(mp=2, sharding=2, fsdp_outer_degree=2), experts=4)
    sf.checkpoint.load(model, opt, f"{root}/mp1")
    out["resumed_mp2"] = [_step(topo, model, opt, 3)]
    return out


def test_checkpoints_reshard_across_mp(tmp_path):
    results = run_distributed(checkpoint_round_trip, 4, str(tmp_path), timeout=JOB_TIMEOUT_S)
    for r in results:
        assert sorted(r["loaded_mp1"]) == sorted(r["saved"]) and any(".experts." in n for n in r["saved"])
        for name, value in r["saved"].items():
            torch.testing.assert_close(r["loaded_mp1"][name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        # the step after each load continues the uninterrupted run (optimizer state resharded with the weights)
        torch.testing.assert_close(r["resumed_mp1"][0], r["uninterrupted"][0], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(r["resumed_mp2"][0], r["uninterrupted"][1], rtol=RTOL, atol=ATOL)


class _SPBlock(torch.nn.Module):
    """Megatron's sequence-parallel pattern: a LayerNorm on this rank's part of the sequence, then column-wise and
    row-wise projections that gather the sequence and scatter it back."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))  # (B, T_local, 16)


class _SPModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_SPBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


SP_BATCH, SP_SEQ = 2, 8


def _sp_data(step: int) -> torch.Tensor:
    return torch.randn(SP_BATCH * 2, SP_SEQ, 16, generator=torch.Generator().manual_seed(500 + step))  # global batch


def sequence_parallel_job() -> dict:
    """SequenceParallel norms (replicated weights whose gradients DTensor sums over mp) inside fully_shard, mp 2 x
    sharding 2: per step the loss (all ranks' parts), the clip norm, and the final parameters."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    import shardfusion as sf

    topo = sf.Topology(mp=2, sharding=2)
    torch.manual_seed(0)
    model = _SPModel()
    plan = {"norm": SequenceParallel(), "fc1": ColwiseParallel(input_layouts=Shard(1)),
            "fc2": RowwiseParallel(output_layouts=Shard(1))}
    for block in model.blocks:
        parallelize_module(block, topo.get_mesh("mp"), plan)
    model = sf.fully_shard(model, topo, units=(_SPBlock,))

    def loss_fn(step):
        x = _sp_data(step)[topo.data_parallel_rank * SP_BATCH:(topo.data_parallel_rank + 1) * SP_BATCH]
        part = x.chunk(2, dim=1)[topo.mp_rank]  # this mp rank's part of the sequence
        # each rank's share of the mean over its data-parallel slice: the mp parts add up in backward
        loss = (model(part) ** 2).sum() / x.numel()
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)  # the mp parts of each slice, summed over the data-parallel ranks
        return float(total) / 2

    out = train_adamw(model, loss_fn, STEPS, LR, MAX_NORM)
    return {**out, "params": sf.full_state_dict(model, buffers=False), "layout": "sp"}


def _sp_reference() -> dict:
    torch.manual_seed(0)
    model = _SPModel()

    def loss_fn(step):
        loss = (model(_sp_data(step)) ** 2).mean()
        loss.backward()
        return loss.detach()

    out = train_adamw(model, loss_fn, STEPS, LR, MAX_NORM)
    return {**out, "params": {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}}


def test_sequence_parallel_norms_under_fully_shard():
    results = run_distributed(sequence_parallel_job, 4, timeout=JOB_TIMEOUT_S)
    want = _sp_reference()
    assert len(results) == 4 and all(len(r["losses"]) == STEPS for r in results)
    for rank, r in enumerate(results):
        assert_run_matches(r, want, f"sequence parallel, rank {rank}", PARAM_ATOL)


def state_dict_job(root: str) -> dict:
    """GPT at mp 2 x sharding 2: model.state_dict() (full-shape DTensors over [replicate, shard, mp]) and torch's DCP
    state-dict API with dcp.save; loaded at mp 1 x sharding 4 (zeroed first), model and AdamW state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.tensor import DTensor

    import shardfusion as sf
    full = StateDictOptions(full_state_dict=True)
    out = {}
    topo, model, opt = _build(dict(mp=2, sharding=2))
    for step in range(2):
        _step(topo, model, opt, step)
    sd = model.state_dict()
    out["state_dict"] = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}
    out["placements"] = {k: (sd[k].device_mesh.mesh_dim_names, tuple(map(str, sd[k].placements)))
                         for k in ("blocks.0.attn.q.weight", "blocks.0.attn.proj.weight", "blocks.0.attn.proj.bias")}
    out["full"] = sf.full_state_dict(model)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=f"{root}/dcp")
    out["saved_optim"] = {k: {n: t.clone() for n, t in v.items()}
                          for k, v in get_optimizer_state_dict(model, opt, options=full)["state"].items()}
    out["uninterrupted"] = _step(topo, model, opt, 2)
    topo, model, opt = _build(dict(mp=1, sharding=4))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=f"{root}/dcp")
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    out["loaded"] = sf.full_state_dict(model)
    out["loaded_optim"] = {k: {n: t.clone() for n, t in v.items()}
                           for k, v in get_optimizer_state_dict(model, opt, options=full)["state"].items()}
    out["resumed"] = _step(topo, model, opt, 2)
    return out


def test_tensor_parallel_state_dict_and_dcp_api(tmp_path):
    from reference import assert_bitwise
    for rank, r in enumerate(run_distributed(state_dict_job, 4, str(tmp_path), timeout=JOB_TIMEOUT_S)):
        assert_bitwise(r["state_dict"], r["full"], f"rank {rank}: state_dict() full_tensor()s")
        assert r["placements"] == {
            "blocks.0.attn.q.weight": (("replicate", "shard", "mp"), ("R", "S(0)", "S(0)")),
            "blocks.0.attn.proj.weight": (("replicate", "shard", "mp"), ("R", "S(0)", "S(1)")),
            "blocks.0.attn.proj.bias": (("replicate", "shard"), ("R", "S(0)")),
        }, r["placements"]
        assert_bitwise(r["loaded"], r["full"], f"rank {rank}: mp 2 -> mp 1 through DCP")
        assert sorted(r["loaded_optim"]) == sorted(r["saved_optim"])
        for name, st in r["saved_optim"].items():
            assert_bitwise(r["loaded_optim"][name], st, f"rank {rank}: optimizer state {name}")
        assert r["resumed"] == pytest.approx(r["uninterrupted"], rel=RTOL, abs=ATOL), rank
