"""The fault-tolerance pieces that need no replica group: the job's --ft-* section (shardfusion.train.ft_config:
its checks, the data slices, where outputs go) and shardfusion.ft's local optimizer state (what a recovery sends,
read without a collective), the lighthouse check and the missing-torchft hint. Whole replica groups, failures and
recoveries: tests/integration/test_train_ft.py."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch

from shardfusion import ft
from shardfusion.train import ft_config as fc
from shardfusion.train.job_ft import shared_settings
from shardfusion.train.config import JobConfig, resolve

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
    ({**ON, "cp": 2}, "--cp 2 with --ft-lighthouse"),
    ({**ON, "fsdp_outer_degree": 2}, "--fsdp-outer-degree 2 with --ft-lighthouse"),
    ({**ON, "optimizer": "muon"}, "--optimizer muon with --ft-lighthouse"),
    ({**ON, "max_restarts": 1, "save_every": 5}, "--max-restarts 1 with --ft-lighthouse"),
    ({**ON, "ft_quorum_timeout": 0.0}, "--ft-quorum-timeout 0.0 must be > 0"),
    ({**ON, "ft_max_discards": 0}, "--ft-max-discards 0 must be >= 1"),
    ({**ON, "ft_lighthouse": "http://10.1.2.3:29510", "ft_host": "127.0.0.1"},
     "--ft-host 127.0.0.1 is this machine's loopback, but the lighthouse is at 10.1.2.3"),
    ({**ON, "ft_lighthouse": "http://10.1.2.3:29510", "ft_host": "localhost"},
     "--ft-host localhost is this machine's loopback"),
])
def test_check_flags_refusals(fields: dict, words: str) -> None:
    with pytest.raises(ValueError, match="^" + words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        (JobConfig.from_flat(**fields)).check_section("ft")


def test_flags_parse_and_defaults() -> None:
    (JobConfig()).check_section("ft")  # off: nothing to check
    config = JobConfig.from_flat(**ON)
    (config).check_section("ft")
    assert (config.ft.ft_min_replicas, config.ft.ft_timeout, config.ft.ft_join_wait, config.ft.ft_host,
            config.ft.ft_quorum_timeout, config.ft.ft_max_discards) == (1, 10.0, 30.0, None, 120.0, 20)
    JobConfig.from_flat(**ON, mp=2).check_section("ft")  # tensor parallel inside each replica group
    resolved = resolve(config, device="cpu", world_size=2, ft_host=fc.resolve_host(config.ft))
    assert resolved.fsdp_outer_degree == 1 and fc.resolve_host(JobConfig().ft) is None
    assert resolved.ft_host == "127.0.0.1"  # the lighthouse is on loopback: so is the way to it
    assert fc.resolve_host(JobConfig.from_flat(**ON, ft_host="10.0.0.7").ft) == "10.0.0.7"  # given: kept


def test_default_host_is_the_address_towards_the_lighthouse() -> None:
    """No packet is sent: the kernel picks the interface that routes to the lighthouse. Loopback for a lighthouse
    on loopback; anything else is an address of this machine that is not loopback (when it has a route at all)."""
    assert ft.reachable_host("http://127.0.0.1:29510") == "127.0.0.1"
    assert ft.reachable_host("http://localhost:29510") == "127.0.0.1"
    try:
        host = ft.reachable_host("http://192.0.2.1:29510")  # TEST-NET-1: routed by a default route, never sent to
    except ValueError as error:  # no default route on this machine
        assert "give it with --ft-host" in str(error)
    else:
        assert not ft.is_loopback(host)
    assert ft.is_loopback("127.3.4.5") and ft.is_loopback("localhost") and not ft.is_loopback("192.0.2.1")


def test_settings_fingerprint_covers_the_arithmetic_not_the_paths() -> None:
    def fingerprint(**fields) -> str:
        config = JobConfig.from_flat(**fields)
        job = resolve(config, device="cpu", world_size=2, ft_host=fc.resolve_host(config.ft))
        return fc.settings_fingerprint(job.marked("ft_shared"))

    base = fingerprint(**ON)
    assert fingerprint(**{**ON, "ft_replica_id": 2, "out": "/mnt/other"}) == base
    assert fingerprint(**ON, ft_host="10.0.0.7", data="/elsewhere") == base
    for change in ({"lr": 1e-3}, {"seed": 7}, {"n_layer": 3}, {"batch_size": 5}, {"ft_replicas": 4},
                   {"mp": 2}):
        assert fingerprint(**{**ON, **change}) != base, change


def test_settings_fingerprint_of_a_run_before_the_sections() -> None:
    """The digest of the settings the job computed before its settings were split into sections
    (tests/fixtures/ft-settings-before-trainer.json: the flags, resolved for 2 ranks on cpu, no data prepared) is
    the digest of the same flags today: replica groups of both versions agree, and the field metadata
    (``ft_shared``) names the same settings the hand-kept list did."""
    fixture = json.loads((Path(__file__).parents[1] / "fixtures" / "ft-settings-before-trainer.json").read_text())
    config = JobConfig.from_flat(**fixture["flags"])
    job = resolve(config, device=fixture["device"], world_size=fixture["world_size"])
    assert fc.settings_fingerprint(job.marked("ft_shared")) == fixture["settings_fingerprint"]
    assert fc.settings_fingerprint(job.replace(lr=1e-3).marked("ft_shared")) != fixture["settings_fingerprint"]
    assert fc.settings_fingerprint(shared_settings(job)) == fixture["settings_fingerprint"]  # what the job sends


def test_settings_fingerprint_with_diloco_covers_the_outer_section() -> None:
    """Under --outer-sync diloco every replica group must run the same outer steps: the outer flags join the
    digest (without DiLoCo they are not in it: the digest of the runs before is unchanged, test above)."""
    def fingerprint(**fields) -> str:
        config = JobConfig.from_flat(**ON, outer_sync="diloco", **fields)
        job = resolve(config, device="cpu", world_size=2, ft_host=fc.resolve_host(config.ft))
        return fc.settings_fingerprint(shared_settings(job))

    base = fingerprint()
    assert fingerprint(ft_join_wait=5.0) == base
    for change in ({"outer_every": 8}, {"outer_lr": 0.7}, {"outer_momentum": 0.9}, {"outer_fragments": 2}):
        assert fingerprint(**change) != base, change


def test_settings_fingerprint_of_a_run_before_tensor_parallel_is_kept() -> None:
    """--mp joined the fingerprint when fault tolerance began to take it (its ``ft_shared`` metadata is
    `FT_SHARED_UNLESS_DEFAULT`): at --mp 1 the fingerprint is the one the job computed before, so groups of both
    versions still agree; at --mp 2 it differs."""
    saved = json.loads((Path(__file__).parents[1] / "fixtures" / "ft-settings-before-trainer.json").read_text())

    def fingerprint(**more) -> str:
        job = resolve(JobConfig.from_flat(**saved["flags"], **more), device=saved["device"],
                      world_size=saved["world_size"])
        return fc.settings_fingerprint(job.marked("ft_shared"))

    assert fingerprint() == saved["settings_fingerprint"]
    assert fingerprint(mp=2) != saved["settings_fingerprint"]


@pytest.mark.parametrize("groups, words", [
    ([(0, 2, 2, "a" * 16), (1, 2, 2, "a" * 16)], None),
    ([(0, 3, 2, "a" * 16), (1, 3, 2, "a" * 16), (2, 3, 2, "a" * 16)], None),
    ([(0, 2, 2, "a" * 16), (0, 2, 2, "a" * 16)], "use the same --ft-replica-id (this one 0)"),
    ([(0, 3, 2, "a" * 16), (1, 3, 2, "a" * 16), (1, 3, 2, "a" * 16)], "use the same --ft-replica-id"),
    ([(0, 2, 2, "a" * 16), (1, 2, 4, "a" * 16)], "different numbers of ranks"),
    ([(0, 2, 2, "a" * 16), (1, 2, 2, "b" * 16)], "different settings"),
    ([(0, 2, 2, "a" * 16), (1, 3, 2, "a" * 16)], "differ in --ft-replicas"),
    ([(0, 70, 2, "f" * 16), (65, 70, 2, "f" * 16)], None),  # ids past ID_BITS: the other checks still hold
    ([(0, 3, 1, "a" * 16), (1, 3, 2, "a" * 16), (2, 3, 3, "a" * 16)], "different numbers of ranks"),  # 2 = mean
    ([(0, 3, 2, "a" * 16), (1, 3, 2, "b" * 16), (2, 3, 2, "c" * 16)], "different settings"),
])
def test_agreement_of_the_quorums_groups(groups: list, words: str | None) -> None:
    """Every group sees the same SUM and MAX of the vectors: every group reaches the same verdict, also when one
    group's value is the mean of the others' (1, 2, 3 ranks)."""
    vectors = [ft.agreement(*g) for g in groups]
    summed = sum(vectors[1:], vectors[0].clone())
    maxed = torch.stack(vectors).max(dim=0).values
    verdicts = [ft.check_agreement(v, summed, maxed, len(groups)) for v in vectors]
    if words is None:
        assert verdicts == [None] * len(groups)
    else:
        assert all(v is not None for v in verdicts) and words in verdicts[0], verdicts


def test_data_slices_are_hsdps() -> None:
    """Replica r's inner rank i takes slice r x inner + i of replicas x inner: HSDP's data-parallel ranks."""
    config = JobConfig.from_flat(**ON)  # replica 1 of 3
    assert [fc.data_slices(config.ft, i, 2) for i in range(2)] == [(2, 6), (3, 6)]
    assert fc.data_slices(JobConfig().ft, 1, 4) == (1, 4) and fc.replicas(JobConfig().ft) == 1
    assert fc.replicas(config.ft) == 3


def test_outputs_folder() -> None:
    assert fc.outputs_folder(JobConfig.from_flat(**ON).ft, "runs/x") == "runs/x/replica-1"
    assert fc.outputs_folder(JobConfig().ft, "runs/x") == "runs/x"


def test_batch_world_counts_the_replicas() -> None:
    from shardfusion.train.config import batch_world
    from shardfusion.train.schedule import resolve_batch
    config = JobConfig.from_flat(**ON, batch_size=4)
    assert batch_world(config, 2) == 6
    assert resolve_batch(config.schedule, dp_world=batch_world(config, 2)) == (4, 24)


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


def test_received_optimizer_state_goes_where_this_ranks_state_lives() -> None:
    """A transport may hand the peer's tensors over on the CPU: they land beside this rank's own state (here the
    meta device stands in for a GPU), a 0-dim ``step`` without state of its own stays on the CPU, as torch keeps it."""
    model, opt = _trained_adamw()
    state = ft.local_optimizer_state(opt)  # CPU tensors, as received
    twin = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to("meta")
    twin_opt = torch.optim.AdamW([{"params": twin[0].parameters()}, {"params": twin[1].parameters()}])
    first = twin[0].weight
    twin_opt.state[first] = {"step": torch.zeros((), device="meta"), "exp_avg": torch.zeros(3, 4, device="meta")}
    ft.load_local_optimizer_state(twin_opt, state)
    assert twin_opt.state[first]["exp_avg"].device.type == "meta"  # beside its own
    assert twin_opt.state[first]["step"].device.type == "meta"
    assert twin_opt.state[first]["exp_avg_sq"].device.type == "meta"  # beside the parameter
    second = twin[1].weight  # no state of its own yet
    assert twin_opt.state[second]["exp_avg"].device.type == "meta"
    assert twin_opt.state[second]["step"].device.type == "cpu"
    fused = torch.optim.AdamW([{"params": twin[0].parameters()}, {"params": twin[1].parameters()}], capturable=True)
    for group in state["groups"]:  # the peer's settings are loaded too: a capturable peer
        group["capturable"] = True
    ft.load_local_optimizer_state(fused, state)  # capturable (or fused): torch keeps step beside the parameter
    assert fused.state[second]["step"].device.type == "meta"


def test_recovery_bytes_count_whole_storages() -> None:
    """PGTransport sends a view's whole storage: the count says what travels."""
    flat = torch.zeros(100)
    assert ft._nbytes({"shards": [flat[:10]], "x": [torch.zeros(3, dtype=torch.float64)]}) == 400 + 24


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



class _Buffer:
    """The part of a flat buffer `ReplicaGroup.sync_gradients` touches."""

    def __init__(self, grad: torch.Tensor | None) -> None:
        self.shard = torch.zeros(3)
        self.grad_shard = grad
        self.fragments = [torch.nn.Parameter(torch.zeros(3))]
        if grad is not None:
            self.fragments[0].grad = grad
        self.attached = False

    def _attach_fragment_grads(self) -> None:
        self.attached = True


class _Work:
    def wait(self) -> None:
        pass


class _TwoGroups:
    """torchft's Manager as this group sees it in a quorum of two: SUM adds the peer's tensor, AVG halves that."""

    def __init__(self, peer: list[torch.Tensor], commit: bool = True) -> None:
        self.peer, self.commit, self.reported = list(peer), commit, []

    def allreduce(self, tensor, reduce_op=None):
        tensor += self.peer.pop(0)
        if reduce_op is None:  # torchft's default: the average over the participants
            tensor /= 2
        return _Work()

    def num_participants(self) -> int:
        return 2

    def errored(self):
        return self.reported[0] if self.reported else None

    def report_error(self, error) -> None:
        self.reported.append(error)

    def should_commit(self) -> bool:
        return self.commit

    def current_step(self) -> int:
        return 0


def _group(buffers: list, manager: _TwoGroups, **fields) -> ft.ReplicaGroup:
    group = ft.ReplicaGroup.__new__(ft.ReplicaGroup)  # no torchft: the arithmetic of a step only
    group.manager, group.optimizers, group.record = manager, [], ft.FTRecord()
    group.min_replicas, group.max_discards, group.host, group._discards_in_a_row = 1, 2, "10.0.0.7", 0
    group._participants = 0
    group.__dict__.update(fields)
    group._buffers = lambda trainable_only=False: buffers
    return group


def test_a_group_without_a_gradient_takes_the_average_when_a_peer_had_one_even_all_zero() -> None:
    """The peer had a gradient of zeros for buffer 0 and none for buffer 1: this group attaches buffer 0's
    average (zeros), as the peer keeps its own, and leaves buffer 1 without one, as the peer does."""
    buffers = [_Buffer(None), _Buffer(None)]
    peer = [torch.zeros(3), torch.zeros(3), torch.tensor([1, 1, 0])]  # grads, then [vote, had 0, had 1]
    _group(buffers, _TwoGroups(peer)).sync_gradients()
    assert buffers[0].attached and torch.equal(buffers[0].grad_shard, torch.zeros(3))
    assert not buffers[1].attached and buffers[1].grad_shard is None


def test_a_vote_short_of_the_participants_discards_the_step() -> None:
    manager = _TwoGroups([torch.ones(3), torch.tensor([0, 1])])  # the peer voted no
    _group([_Buffer(torch.ones(3))], manager).sync_gradients()
    assert manager.reported and "vote 1 of 2" in str(manager.reported[0])


def test_steps_discarded_in_a_row_stop_the_group_in_one_line() -> None:
    """With enough replicas, --ft-max-discards (here 2) consecutive discards end the run; a commit resets the
    count, and discards while below min_replicas (a wait) do not count."""
    group = _group([], _TwoGroups([], commit=False), _participants=2)
    assert group.commit() is False and group.commit() is False
    group.manager.commit = True
    assert group.commit() is True and group._discards_in_a_row == 0
    group.manager.commit = False
    group.min_replicas = 3  # below it: waiting, not failing
    for _ in range(5):
        group.commit()
    group.min_replicas = 1
    group.commit(), group.commit()
    with pytest.raises(ft.FTError, match=r"^3 steps in a row discarded with 2 replica groups in the quorum "
                                         r"\(--ft-max-discards 2\).*--ft-host 10\.0\.0\.7\?$"):
        group.commit()


def test_torchft_output_goes_to_its_log_file(tmp_path, caplog: pytest.LogCaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`job_ft.route_torchft_output`: torchft's loggers (INFO and up, tracebacks too) and the warnings raised in its
    files go to OUT/replica-<id>/torchft.log, none to the root logger's handlers (the console); other warnings and
    loggers are left alone. And RUST_LOG (its Rust side's level) is set to warn unless set (`quiet_torchft_rust`)."""
    import logging
    import os
    import warnings

    from shardfusion.train import job_ft
    for name in job_ft.TORCHFT_LOGGERS:  # restored after the test
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "handlers", list(logger.handlers))
        monkeypatch.setattr(logger, "propagate", logger.propagate)
        monkeypatch.setattr(logger, "level", logger.level)
    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *args, **kwargs: shown.append(str(message)))
    caplog.set_level(logging.INFO)
    path = job_ft.route_torchft_output(tmp_path / "replica-1", rank=3)
    assert path == tmp_path / "replica-1" / job_ft.LOG_FILE
    logging.getLogger("torchft.manager").info("[replica_1/0 - step 4] should_commit=True")
    logging.getLogger("torchft_quorums").info("", extra={"quorum_id": 2})  # OpenTelemetry data only: not written
    try:
        raise RuntimeError("a peer died")
    except RuntimeError:
        logging.getLogger("torchft.manager").exception("got exception in recovery")
    warnings.showwarning(UserWarning("buffer is not writable"), UserWarning,
                         f"{tmp_path}/site-packages/torchft/checkpointing/pg_transport.py", 213)
    warnings.showwarning(UserWarning("a warning of the job's own"), UserWarning, "/x/shardfusion/train/job.py", 1)
    logging.getLogger("other").warning("not torchft's")
    lines = path.read_text().splitlines()
    assert lines[0].endswith("rank 3 torchft.manager INFO: [replica_1/0 - step 4] should_commit=True"), lines
    assert "rank 3 torchft.manager ERROR: got exception in recovery" in lines[1]
    assert "RuntimeError: a peer died" in lines
    assert any("pg_transport.py:213: UserWarning: buffer is not writable" in line for line in lines)
    assert not any("quorums" in line or "job's own" in line or "not torchft's" in line for line in lines)
    assert shown == ["a warning of the job's own"]
    assert [r.name for r in caplog.records] == ["other"]  # torchft's records never reach the root logger
    job_ft.route_torchft_output(tmp_path / "replica-1", rank=3)  # again: one handler, not two
    assert sum(isinstance(h, logging.FileHandler) for h in logging.getLogger("torchft").handlers) == 1
    monkeypatch.delenv("RUST_LOG", raising=False)
    job_ft.quiet_torchft_rust()
    assert os.environ["RUST_LOG"] == "warn"
    monkeypatch.setenv("RUST_LOG", "info")
    job_ft.quiet_torchft_rust()
    assert os.environ["RUST_LOG"] == "info"
