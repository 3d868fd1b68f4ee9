"""The arrival deadline's sources and the verdict of an arrival check (shardfusion/arrival.py), in one process; the
checks themselves run on gloo ranks in tests/distributed/test_some_ranks_only.py."""

from __future__ import annotations

import types

import pytest

from shardfusion import arrival


def test_deadline_from_topology_then_environment_then_default(monkeypatch):
    monkeypatch.delenv(arrival.DEADLINE_ENV, raising=False)
    assert arrival.deadline() == arrival.DEFAULT_DEADLINE_S == 60.0
    monkeypatch.setenv(arrival.DEADLINE_ENV, "2.5")
    assert arrival.deadline() == 2.5
    assert arrival.deadline(types.SimpleNamespace(arrival_timeout=None)) == 2.5
    assert arrival.deadline(types.SimpleNamespace(arrival_timeout=7.0)) == 7.0


@pytest.mark.parametrize("text", ["0", "-1", "soon", "inf", "nan"])
def test_a_bad_environment_deadline_is_refused_naming_the_variable(monkeypatch, text):
    monkeypatch.setenv(arrival.DEADLINE_ENV, text)
    with pytest.raises(ValueError, match=f"SHARDFUSION_ARRIVAL_TIMEOUT='{text}'"):
        arrival.deadline()


def test_verdict_names_calls_before_values():
    ranks = [0, 1, 2, 3]
    assert arrival._verdict(ranks, ["a\nx"] * 4) == "same"
    assert arrival._verdict(ranks, ["a\nx", "a\ny", "a\ny", "a\nx"]) == "values\nranks [0, 3]: x; ranks [1, 2]: y"
    assert arrival._verdict(ranks, ["a\nx", "b\nx", "b\ny", "a\nx"]) == "calls\nranks [0, 3]: a; ranks [1, 2]: b"


def test_no_process_group_no_check():
    assert arrival.check("model.state_dict()", [0, 1], 1.0, "v") is None
