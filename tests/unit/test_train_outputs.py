"""The training job's outputs and metrics in one process: the expert-balance and communication figures of the
summary, metrics.jsonl across a resume (records after the checkpoint moved aside, a torn last line dropped),
config.json of a resumed run, the files of an earlier run moved aside by a new one, the line of a run with nothing
left to train, and the start line on the ZeRO++ options (whole runs print it: tests/integration/test_train.py)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardfusion.accounting import CATEGORIES
from shardfusion.train.metrics import (COMM_FIELDS, MetricsLog, comm_per_step, comm_step_record, expert_balance,
                                       format_comm, read_metrics)
from shardfusion.train.outputs import open_outputs, write_config
from shardfusion.train.parallelize import ZERO_PP, zero_pp_line
from shardfusion.train.trainer_outputs import nothing_to_train


def test_expert_balance() -> None:
    figures = expert_balance([[1, 3], [2, 2]])  # (L, E) = 2 layers, 2 experts
    assert figures == {"tokens_per_expert": [3, 5], "load_balance": 1.25, "worst_layer_balance": 1.5}
    assert expert_balance([[4, 4, 4, 4]])["load_balance"] == 1.0


def test_comm_summary_figures() -> None:
    def summary(count: int, wire: float, cross: float, wait: float) -> dict:
        row = {"count": count, "bytes": 2 * wire, "wire_bytes": wire, "cross_node_bytes": cross, "wait_s": wait}
        return {cat: dict(row) if cat == "replicate_all_reduce" else {k: 0 for k in row} for cat in CATEGORIES}

    steps = [{"comm": comm_step_record(summary(3, 1000.0, 500.0, 0.01))},
             {"comm": comm_step_record(summary(3, 3000.0, 1500.0, 0.03))}, {"val_loss": 1.0}]
    assert list(steps[0]["comm"]["other"]) == list(COMM_FIELDS)  # the logical bytes are left out
    per_step = comm_per_step(steps)
    assert per_step["replicate_all_reduce"] == {"count": 3, "wire_bytes": 2000.0, "cross_node_bytes": 1000.0,
                                                "wait_s": pytest.approx(0.02)}
    assert per_step["other"] == {"count": 0, "wire_bytes": 0, "cross_node_bytes": 0, "wait_s": 0}
    lines = format_comm({"ranks_per_node": 2, "nodes": 2, "ranks_per_node_from": "--ranks-per-node",
                         "per_step": per_step, "wire_bytes_per_step": 2000.0, "cross_node_bytes_per_step": 1000.0,
                         "wait_s_per_step": 0.02}, steps=2)
    assert lines[0] == "comm per step    rank 0, mean of 2 steps; 2 nodes of 2 ranks (--ranks-per-node)"
    replicate = next(line for line in lines if "replicate all-reduce" in line)
    assert replicate.split() == ["replicate", "all-reduce", "3", "2.00", "kB", "1.00", "kB", "20.0", "ms"]


def test_metrics_log_resume_keeps_records_up_to_the_checkpoint(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path)
    log.log_val(step=0, val_loss=5.0, val_bpb=7.214, elapsed_s=0.0)
    for step in range(1, 9):
        log.log_train(step=step, loss=1.0 / step, grad_norm=1.0, lr=0.1, tokens_per_s=1.0, elapsed_s=step)
    log.log_val(step=4, val_loss=4.0, val_bpb=5.771, elapsed_s=4.0)
    log.log_val(step=8, val_loss=3.0, val_bpb=4.328, elapsed_s=8.0)

    resumed = MetricsLog(tmp_path, resume_step=5)  # a checkpoint at step 5; steps 6..8 will run again
    assert [r["step"] for r in resumed.train] == [1, 2, 3, 4, 5] and [r["step"] for r in resumed.val] == [0, 4]
    assert resumed.dropped == 4
    train, val = read_metrics(tmp_path / "metrics.jsonl")
    assert train == resumed.train and val == resumed.val
    dropped_train, dropped_val = read_metrics(tmp_path / "metrics.dropped.jsonl")  # moved, not deleted
    assert [r["step"] for r in dropped_train] == [6, 7, 8] and [r["step"] for r in dropped_val] == [8]
    resumed.log_train(step=6, loss=0.5, grad_norm=1.0, lr=0.1, tokens_per_s=1.0, elapsed_s=6.0)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")[0]] == [1, 2, 3, 4, 5, 6]
    assert MetricsLog(tmp_path).train == [] and (tmp_path / "metrics.jsonl").read_text() == ""  # a new run


def test_config_of_a_resumed_run(tmp_path: Path) -> None:
    first = {"lr": 0.1, "stop_after": 5, "steps": 10}
    write_config(tmp_path, first, resumed=None)
    resumed = {"checkpoint": "x/step-5", "step": 5, "notes": []}
    write_config(tmp_path, {**first, "stop_after": None}, resumed=resumed)  # only run control differs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    assert json.loads((tmp_path / "config.json").read_text())["resumed"] == resumed
    write_config(tmp_path, {**first, "lr": 0.2}, resumed={**resumed, "step": 7})  # other settings: keep the old
    assert json.loads((tmp_path / "config.step-7.json").read_text())["lr"] == 0.1
    assert json.loads((tmp_path / "config.json").read_text())["lr"] == 0.2


def test_a_new_run_moves_the_files_of_an_earlier_one_aside(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "config.json").write_text('{"lr": 1}\n')
    opened: list = []
    assert open_outputs(tmp_path, {"lr": 2}, None, opened) == str(tmp_path / "earlier-1")
    assert (tmp_path / "earlier-1" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (tmp_path / "earlier-1" / "config.json").read_text() == '{"lr": 1}\n'
    assert json.loads((tmp_path / "config.json").read_text()) == {"lr": 2} and opened[0].train == []
    assert open_outputs(tmp_path, {"lr": 3}, None, []) == str(tmp_path / "earlier-2")  # never over earlier-1
    assert json.loads((tmp_path / "earlier-2" / "config.json").read_text()) == {"lr": 2}
    # a resume keeps the files (and archives an unreadable config.json as it is)
    (tmp_path / "config.json").write_text('{"lr": ')
    assert open_outputs(tmp_path, {"lr": 3}, {"checkpoint": "c", "step": 0, "notes": []}, []) is None
    assert (tmp_path / "config.step-0.json").read_text() == '{"lr": '


def test_metrics_log_drops_a_torn_line(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path)
    log.log_train(step=1, loss=1.0, grad_norm=1.0, lr=0.1, tokens_per_s=1.0, elapsed_s=1.0)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "loss": 4.5, "grad_n')  # a crash in the middle of a write
    resumed = MetricsLog(tmp_path, resume_step=1)
    assert [r["step"] for r in resumed.train] == [1] and resumed.dropped == 1
    assert (tmp_path / "metrics.dropped.jsonl").read_text() == '{"step": 2, "loss": 4.5, "grad_n\n'


class _Nodes:
    """The part of `sf.Topology` the ZeRO++ line reads (a real one needs a process group: the whole runs use one)."""

    def __init__(self, world_size: int, ranks_per_node: int, spanning: list[str]) -> None:
        self.world_size, self.ranks_per_node, self.spanning_groups = world_size, ranks_per_node, spanning

    def describe_nodes(self) -> str:
        nodes = self.world_size // self.ranks_per_node
        return f"{nodes} nodes x {self.ranks_per_node} ranks" + ("; spans" if self.spanning_groups else "")


def test_zero_pp_start_line() -> None:
    two_nodes, hsdp, one_node = _Nodes(4, 2, ["fsdp_inner"]), _Nodes(4, 2, []), _Nodes(4, 4, [])
    off = {"all_gather_dtype": None, "grad_comm_dtype": None}  # a build without --secondary-shard: left out
    assert zero_pp_line(off, one_node) is None  # one node, nothing on: no line
    assert zero_pp_line(off, two_nodes) == "ZeRO++: qwZ off, qgZ off; 2 nodes x 2 ranks; spans"
    assert zero_pp_line(off, hsdp) == "ZeRO++: qwZ off, qgZ off; 2 nodes x 2 ranks; every sharding group within a node"
    on = {"all_gather_dtype": "int8", "secondary_shard": True, "grad_comm_dtype": "int8"}
    assert zero_pp_line(on, one_node) == ("ZeRO++: qwZ on (--all-gather-dtype int8), hpZ on (--secondary-shard), "
                                          "qgZ on (--grad-comm-dtype int8); 1 nodes x 4 ranks")
    assert zero_pp_line({**on, "secondary_shard": False, "grad_comm_dtype": "bf16"}, two_nodes) == (
        "ZeRO++: qwZ on (--all-gather-dtype int8), hpZ off, qgZ off; 2 nodes x 2 ranks; spans")
    assert [name for name, _, _ in ZERO_PP] == ["all_gather_dtype", "secondary_shard", "grad_comm_dtype"]


def test_nothing_to_train_names_the_stop_and_how_to_go_on() -> None:
    """The line of a resumed run whose checkpoint is at its stop (the job's runs: tests/integration/
    test_train_resume.py): the stop it reached, --stop-after's or --steps', and a way on only after --stop-after."""
    def line(stop_after: int | None, steps: int) -> str:
        schedule = SimpleNamespace(stop_after=stop_after, steps=steps)
        trainer = SimpleNamespace(schedule=schedule, stop=stop_after or steps, start=stop_after or steps,
                                  resume_from="OUT/checkpoints/step-4", out="OUT")
        return nothing_to_train(trainer)

    stopped = line(4, 30)
    assert stopped.startswith("shardfusion: nothing to train: OUT/checkpoints/step-4 is at step 4, and this run "
                              "stops at --stop-after 4") and stopped.endswith("; outputs in OUT are kept")
    assert "to go on, run again with a larger --stop-after, or without it" in stopped
    finished = line(None, 6)
    assert "nothing to train" in finished and "this run stops at --steps 6" in finished and "to go on" not in finished
