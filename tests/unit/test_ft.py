"""The fault-tolerance pieces that need no replica group: the job's --ft-* section (shardfusion.train.ft_config:
its checks, the data slices, where outputs go) and shardfusion.ft's local optimizer state (what a recovery sends,
read without a collective), the lighthouse check and the missing-torchft hint. Whole replica groups, failures and
recoveries: tests/integration/test_train_ft.py."""

from __future__ import annotations

import socket
import sys

import pytest
import torch

from shardfusion import ft
from shardfusion.train import ft_config as fc
from shardfusion.train.config import TrainConfig

ON = dict(ft_lighthouse="http://127.0.0.1:1", ft_replicas=3, ft_replica_id=1, out="runs/x")


@pytest.mark.parametrize("fields, words", [
    ({"ft_replica_id": 0}, "--ft-replica-id needs --ft-lighthouse"),
    ({"ft_replicas": 2}, "--ft-replicas needs --ft-lighthouse"),
    ({**ON, "ft_replicas": None}, "--ft-lighthouse needs --ft-replicas >= 1"),
    ({**ON, "ft_replica_id": 3}, "--ft-replica-id 3 must be in 0 .. 2 (--ft-replicas 3)"),
    ({**ON, "ft_replica_id": None}, "--ft-lighthouse needs --ft-replica-id (this replica group's id, 0 .. 2)"),
    ({**ON, "ft_min_replicas": 0}, "--ft-min-replicas 0 must be in 1 .. --ft-replicas 3"),
    ({**ON, "ft_timeout": 0.0}, "--ft-timeout 0.0 must be > 0"),
    ({**ON, "ft_join_wait": -1.0}, "--ft-join-wait -1.0 must be >= 0"),
    ({**ON, "out": None}, "--ft-lighthouse needs --out"),
    ({**ON, "mp": 2}, "--mp 2 with --ft-lighthouse"),
    ({**ON, "fsdp_outer_degree": 2}, "--fsdp-outer-degree 2 with --ft-lighthouse"),
    ({**ON, "optimizer": "muon"}, "--optimizer muon with --ft-lighthouse"),
    ({**ON, "max_restarts": 1, "save_every": 5}, "--max-restarts 1 with --ft-lighthouse"),
])
def test_check_flags_refusals(fields: dict, words: str) -> None:
    with pytest.raises(ValueError, match="^" + words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        fc.check_flags(TrainConfig(**fields))


def test_flags_parse_and_defaults() -> None:
    fc.check_flags(TrainConfig())  # off: nothing to check
    config = TrainConfig(**ON)
    fc.check_flags(config)
    assert (config.ft_min_replicas, config.ft_timeout, config.ft_join_wait, config.ft_host) == (1, 10.0, 30.0,
                                                                                                "127.0.0.1")
    assert fc.resolve(config).fsdp_outer_degree == 1 and fc.resolve(TrainConfig()).fsdp_outer_degree is None


def test_data_slices_are_hsdps() -> None:
    """Replica r's inner rank i takes slice r x inner + i of replicas x inner: HSDP's data-parallel ranks."""
    config = TrainConfig(**ON)  # replica 1 of 3
    assert [fc.data_slices(config, i, 2) for i in range(2)] == [(2, 6), (3, 6)]
    assert fc.data_slices(TrainConfig(), 1, 4) == (1, 4) and fc.replicas(TrainConfig()) == 1
    assert fc.replicas(config) == 3


def test_outputs_folder() -> None:
    assert fc.outputs_folder(TrainConfig(**ON), "runs/x") == "runs/x/replica-1"
    assert fc.outputs_folder(TrainConfig(), "runs/x") == "runs/x"


def test_batch_world_counts_the_replicas() -> None:
    from shardfusion.train.config import batch_world, resolve_batch
    config = TrainConfig(**ON, batch_size=4)
    assert batch_world(config, 2) == 6
    assert resolve_batch(config, dp_world=batch_world(config, 2)).global_batch_size == 24


def _trained_adamw() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 1e-2}, {"params": model[1].parameters()}])
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def test_local_optimizer_state_round_trip() -> None:
    """A peer's state (same shapes) loads into a fresh optimizer: the next step is then bitwise the peer's."""
    model, opt = _trained_adamw()
    state = ft.local_optimizer_state(opt)
    assert len(state["groups"]) == 2 and "params" not in state["groups"][0] and state["groups"][0]["lr"] == 1e-2
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for g in state["state"] for s in g)
    twin = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    twin.load_state_dict(model.state_dict())
    twin_opt = torch.optim.AdamW([{"params": twin[0].parameters()}, {"params": twin[1].parameters()}])
    ft.load_local_optimizer_state(twin_opt, state)
    assert twin_opt.param_groups[0]["lr"] == 1e-2
    before = opt.state[model[0].weight]["exp_avg"].clone()
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad()
        m(torch.ones(2, 4)).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(before, opt.state[model[0].weight]["exp_avg"])  # copies, not the peer's tensors
    with pytest.raises(RuntimeError, match="2 parameter groups, this one 1"):
        ft.load_local_optimizer_state(torch.optim.AdamW(twin.parameters()), state)


def test_check_lighthouse_errors() -> None:
    with pytest.raises(ValueError, match="must be an http://host:port address"):
        ft.check_lighthouse("127.0.0.1:29510")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    with pytest.raises(ValueError, match=rf"^--ft-lighthouse http://127.0.0.1:{port}: no lighthouse answers there"):
        ft.check_lighthouse(f"http://127.0.0.1:{port}", timeout_s=2)


def test_missing_torchft_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ValueError, match=r"needs the torchft package \(pip install 'shardfusion\[ft\]'\)"):
        ft.import_torchft()

