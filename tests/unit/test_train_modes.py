"""The Trainer's modes (`shardfusion.train.mode`, `trainer.modes_for`): which modes a run's flags compose, in which
order, and how a hook is answered (decided by the first mode that overrides it, or added over all of them). The
modes' behaviour is proved by the job's runs (tests/integration/test_train*.py); this file checks the composition
itself, with hand-written modes as the reference."""

from __future__ import annotations

import pytest

from shardfusion.train.config import JobConfig, resolve
from shardfusion.train.mode import Mode, Modes
from shardfusion.train.trainer import modes_for


@pytest.mark.parametrize("flags, names", [
    ({}, ["PlainMode"]),
    ({"pp": 2}, ["PipelineMode"]),
    ({"outer_sync": "diloco", "fsdp_outer_degree": 2}, ["OuterMode", "PlainMode"]),
    ({"ft_lighthouse": "http://localhost:29510", "ft_replicas": 2, "ft_replica_id": 0}, ["FTMode", "PlainMode"]),
])
def test_the_flags_compose_the_modes_in_order(flags: dict, names: list[str]) -> None:
    config = resolve(JobConfig.from_flat(preset="tiny", **flags), device="cpu", world_size=2, nproc=2,
                     ft_host="localhost" if "ft_lighthouse" in flags else None)
    assert [type(m).__name__ for m in modes_for(config)] == names


class _Commits(Mode):
    def __init__(self, answer: bool) -> None:
        self.answer = answer

    def commit(self, step: int) -> bool:
        return self.answer

    def record(self, comm: dict) -> dict:
        return {"first": self.answer, "shared": 1}


class _Boundary(Mode):
    def boundary(self, done: int) -> dict:
        return {"synced": [done]}

    def record(self, comm: dict) -> dict:
        return {"shared": 2, "last": True}


def test_a_decided_hook_is_answered_by_the_first_mode_that_overrides_it() -> None:
    modes = Modes([_Boundary(), _Commits(False), _Commits(True)])
    assert modes.first("commit")(3) is False  # the first overriding one; _Boundary does not override commit
    assert modes.first("steps", lambda: "default")() == "default"  # nobody overrides it: the trainer's default
    with pytest.raises(LookupError, match="forward_backward"):
        modes.first("forward_backward")  # a run without a model mode


def test_an_added_hook_runs_every_overriding_mode_and_merges_in_order() -> None:
    modes = Modes([_Commits(False), _Boundary()])
    assert modes.merged("record", {}) == {"first": False, "shared": 2, "last": True}
    assert list(modes.merged("record", {})) == ["first", "shared", "last"]  # key order: the modes' order
    assert modes.merged("boundary", 4) == {"synced": [4]}
    assert modes.merged("summary", None) == {} and not modes.has("summary")
    assert [hook.__self__ for hook in modes.each("boundary")] == [modes.modes[1]]
