"""Frozen base layers: LoRA adapters on frozen ``nn.Linear`` layers, frozen embeddings, a frozen whole block, and
``requires_grad_(False)`` set before the wrap in a mix of these, against one process.

One W=4 job runs every case: FSDP 4 and HSDP 2 x 2, each reshard policy. A case trains 3 AdamW steps on a small
token model (embedding, 4 blocks of two Linear layers, head); each rank takes its rows of the global batch. The
reference is the same model in one process on the whole batch. Losses, the trained parameters (``sf.full_state_dict``)
and the frozen ones (unchanged, bitwise) are compared.

Before the fix, backward raised ``setStorage: ... out of bounds for storage of size 0`` on every rank: a unit was
freed as soon as its trainable views had their gradients, while autograd still needed its frozen weight for the
gradient of the unit's input. The test also checks that frozen units are still freed during backward (the number of
units gathered at once stays that of a fully trainable model), not only at its end.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import run_distributed

WORLD = 4
VOCAB, D, LAYERS, ROWS, SEQ = 32, 16, 4, 8, 6
STEPS, LR = 3, 1e-2
VARIANTS = ("lora", "lora_bias_trainable", "frozen_embedding", "frozen_block", "mix")
BASELINE = "trainable"  # nothing frozen: the units a backward holds at once
LAYOUTS = ((4, 1), (2, 2))  # (inner, outer)
POLICIES = ("after_forward", "after_backward")
JOB_TIMEOUT_S = 240


class LoRALinear(nn.Module):
    """``base(x) + x A^T B^T``: a rank-``r`` adapter beside a (frozen) Linear layer."""

    def __init__(self, base: nn.Linear, r: int = 2) -> None:
        super().__init__()
        self.base = base
        self.A = nn.Parameter(torch.randn(r, base.in_features) * 0.1)
        self.B = nn.Parameter(torch.randn(base.out_features, r) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.A.t()) @ self.B.t()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x):  # (B, T, D)
        return x + self.fc2(torch.tanh(self.fc1(x)))


class TokenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x, y):  # x, y: (B, T) int64
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def build(variant: str) -> nn.Module:
    torch.manual_seed(0)
    model = TokenNet()
    if variant in ("lora", "lora_bias_trainable", "mix"):
        for b in model.blocks:
            for name in ("fc1", "fc2"):
                base = getattr(b, name)
                base.weight.requires_grad_(False)
                if variant != "lora_bias_trainable":
                    base.bias.requires_grad_(False)
                setattr(b, name, LoRALinear(base))
    if variant in ("frozen_embedding", "mix"):
        model.emb.weight.requires_grad_(False)
    if variant in ("frozen_block", "mix"):
        model.blocks[1].requires_grad_(False)
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def reference(variant: str) -> dict:
    model = build(variant)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model(*batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def lora_job() -> dict:
    import torch.distributed as dist
    import shardfusion as sf
    from shardfusion._runtime.state import sharded_state

    out = {}
    for inner, outer in LAYOUTS:
        topo = sf.Topology(sharding=WORLD, fsdp_outer_degree=outer)
        dp_world, dp_rank = topo.gradient_divisor, topo.data_parallel_rank
        for policy in POLICIES:
            for variant in (BASELINE, *VARIANTS):
                model = sf.fully_shard(build(variant), topo, units=(Block,), reshard_policy=policy)
                opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
                losses, peaks = [], []
                for step in range(STEPS):
                    x, y = batch(step)
                    rows = ROWS // dp_world
                    loss = model(x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows])
                    sharded_state(model).peak_unsharded_units = 0
                    loss.backward()
                    peaks.append(sharded_state(model).peak_unsharded_units)
                    opt.step()
                    opt.zero_grad()
                    t = loss.detach().clone()
                    dist.all_reduce(t)
                    losses.append(float(t) / WORLD)
                out[(inner, outer, policy, variant)] = {"losses": losses, "peaks": peaks,
                                                        "params": sf.full_state_dict(model)}
    return out


@pytest.fixture(scope="module")
def lora_results():
    return run_distributed(lora_job, WORLD, timeout=JOB_TIMEOUT_S)


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("variant", VARIANTS)
def test_frozen_base_layers_match_single_process(lora_results, variant):
    ref = reference(variant)
    frozen = {n for n, p in build(variant).named_parameters() if not p.requires_grad}
    assert frozen, variant
    baseline = {key[:3]: got["peaks"] for key, got in lora_results[0].items() if key[3] == BASELINE}
    initial = {n: p.detach() for n, p in build(variant).named_parameters()}
    for (inner, outer, policy, v), got in lora_results[0].items():
        if v != variant or v == BASELINE:
            continue
        what = f"{variant}, inner {inner} x outer {outer}, {policy}"
        for a, b in zip(got["losses"], ref["losses"]):
            assert abs(a - b) < 1e-5, f"{what}: losses {got['losses']} != reference {ref['losses']}"
        for n, want in ref["params"].items():
            have = got["params"][n]
            if n in frozen:
                assert torch.equal(have, initial[n]), f"{what}: frozen {n} changed"
            else:
                torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {n}: {m}")
        # Freed during backward as a fully trainable model's units are, not kept until its end.
        assert got["peaks"] <= baseline[(inner, outer, policy)], (
            f"{what}: units gathered at once in backward {got['peaks']}, trainable model "
            f"{baseline[(inner, outer, policy)]}")
        if policy == "after_forward":
            assert max(got["peaks"]) < LAYERS, f"{what}: every block was gathered at once: {got['peaks']}"
    for rank, r in enumerate(lora_results[1:], start=1):  # every rank agrees with rank 0
        for key, got in r.items():
            assert got["losses"] == lora_results[0][key]["losses"], f"rank {rank} {key}"
