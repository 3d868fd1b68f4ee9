"""The training job's experiment trackers (--log, `shardfusion.train.trackers`) fed by a `MetricsLog` in one process,
each read back with its own package's reader (tests/trackers_readback.py): every scalar of metrics.jsonl at its step,
the config, the loss plot, a resume that continues the same run and step axis; the flag's errors; and the loss
plot's events (outer syncs, fault-tolerance events, resume points) as matplotlib artists."""

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import REPO
from shardfusion.accounting import CATEGORIES
from shardfusion.train import trackers
from shardfusion.train.metrics import EVENTS, MetricsLog, plot_losses, read_metrics, run_events
from trackers_readback import (tensorboard_accumulator, tensorboard_scalars, trackio_logs, wandb_records,
                               wandb_runs)

CONFIG = {"preset": "tiny", "lr": 0.003, "steps": 8, "out": None, "corpus": {"bytes": 300000}, "log": ""}


def _comm(step: int) -> dict:
    return {cat: {"count": 2, "wire_bytes": 1000.0 * step, "cross_node_bytes": 0.0, "wait_s": 0.001 * step}
            for cat in CATEGORIES}


def _train(step: int, scale: float = 1.0) -> dict:
    """A GPT-MoE DiLoCo run's training record (every kind of value the job writes: nested, lists, counts)."""
    return {"step": step, "loss": scale * 5.0 / step, "grad_norm": 1.0 + step / 10, "lr": 0.003 * step / 8,
            "tokens_per_s": 1000.0 + step, "elapsed_s": 0.5 * step, "aux_loss": 0.01 * step,
            "tokens_per_expert": [step, 2 * step], "load_balance": 1.1, "worst_layer_balance": 1.2,
            "outer_synced": [0] if step % 4 == 0 else [], "ft_participants": 2, "comm": _comm(step)}


def _val(step: int, scale: float = 1.0) -> dict:
    return {"step": step, "val_loss": scale * 6.0 / (step + 1), "val_bpb": scale * 8.0 / (step + 1),
            "elapsed_s": 0.5 * step}


def _run(out: Path, log: tuple, steps=range(1, 9), resume_step=None, scale=1.0) -> MetricsLog:
    """A MetricsLog with trackers ``log`` fed the records of ``steps`` (an evaluation every 4 steps and at 0), then
    the plot, then closed."""
    metrics = MetricsLog(out, resume_step=resume_step, log=log, config={**CONFIG, "out": str(out)})
    if resume_step is None:
        metrics.log_val(**_val(0, scale))
    for step in steps:
        metrics.log_train(**_train(step, scale))
        if step % 4 == 0:
            metrics.log_val(**_val(step, scale))
    plot_losses(metrics, out / "loss.png")
    metrics.close()
    return metrics


def _expected(out: Path) -> dict[str, dict[int, float]]:
    """{scalar: {step: value}} of OUT/metrics.jsonl, as the trackers name them."""
    expected: dict[str, dict[int, float]] = {}
    train, val = read_metrics(out / "metrics.jsonl")
    for record in train + val:
        for name, value in trackers.scalars(record).items():
            expected.setdefault(name, {})[record["step"]] = value
    return expected


def test_scalars_name_every_number_of_a_record() -> None:
    values = trackers.scalars({**_train(4), "resumed_from_step": 2, "note": "text", "none": None})
    assert values["loss"] == 1.25 and values["comm/inner_all_gather/wire_bytes"] == 4000.0
    assert values["tokens_per_expert/1"] == 8.0 and values["outer_synced"] == 1.0 and values["resumed_from_step"] == 2
    assert "step" not in values and "note" not in values and "none" not in values
    assert len([k for k in values if k.startswith("comm/")]) == 4 * len(CATEGORIES)


def test_log_flag_errors(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardfusion.train.config import parse_args

    assert trackers.parse_log("wandb, tensorboard,wandb") == ("wandb", "tensorboard") and trackers.parse_log("") == ()
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--log", "tensorboard,mlflow"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "shardfusion-train: error: --log 'tensorboard,mlflow': unknown tracker 'mlflow'; choose any of tensorboard, "
        "wandb, trackio, comma-separated"]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(SystemExit):
        parse_args(["--log", "tensorboard,wandb"])
    assert capsys.readouterr().err.strip().splitlines() == [
        "shardfusion-train: error: --log wandb needs the wandb package, which is not installed: pip install "
        "'shardfusion[wandb]'"]


def test_the_job_imports_no_tracker_it_was_not_asked_for() -> None:
    code = ("import sys, shardfusion.train.job; from shardfusion.train.config import parse_args; "
            "parse_args(['--log', 'tensorboard,wandb,trackio']); "
            "print([m for m in sys.modules if m.split('.')[0] in ('tensorboard', 'wandb', 'trackio') "
            "or m.startswith('torch.utils.tensorboard')])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_tensorboard_holds_every_scalar_the_config_and_the_plot(tmp_path: Path) -> None:
    _run(tmp_path, ("tensorboard",))
    got = tensorboard_scalars(tmp_path / "tensorboard")
    expected = _expected(tmp_path)
    assert set(got) == set(expected) and {"loss", "val_loss", "val_bpb", "grad_norm", "lr", "tokens_per_s",
                                          "comm/replicate_all_reduce/wait_s", "tokens_per_expert/0"} <= set(got)
    for name, by_step in expected.items():  # TensorBoard keeps float32
        assert got[name] == {s: pytest.approx(v, rel=1e-6) for s, v in by_step.items()}, name
    acc = tensorboard_accumulator(tmp_path / "tensorboard")
    (image,) = acc.Images(trackers.PLOT_TAG)
    assert image.step == 8 and image.width > 100
    from tensorboard.plugins.hparams import plugin_data_pb2

    start = plugin_data_pb2.HParamsPluginData.FromString(
        acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["lr"].number_value == 0.003 and start.hparams["preset"].string_value == "tiny"
    assert json.loads(start.hparams["corpus"].string_value) == {"bytes": 300000}
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(text) == {**CONFIG, "out": str(tmp_path)}


def test_tensorboard_resume_continues_the_step_axis(tmp_path: Path) -> None:
    _run(tmp_path, ("tensorboard",))  # steps 1..8 logged, a checkpoint at step 5
    _run(tmp_path, ("tensorboard",), steps=range(6, 11), resume_step=5, scale=2.0)  # 6..10 again, other values
    losses = tensorboard_scalars(tmp_path / "tensorboard")["loss"]
    assert sorted(losses) == list(range(1, 11))  # each step once: the interrupted run's 6..8 purged
    train = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert losses == {r["step"]: pytest.approx(r["loss"], rel=1e-6) for r in train}
    assert losses[6] == pytest.approx(2 * 5.0 / 6, rel=1e-6)
    assert tensorboard_scalars(tmp_path / "tensorboard")["resumed_from_step"] == {6: 5.0}


def test_tensorboard_added_at_a_resume_gets_the_kept_records(tmp_path: Path) -> None:
    _run(tmp_path, ())  # no tracker
    _run(tmp_path, ("tensorboard",), steps=range(6, 9), resume_step=5)
    assert tensorboard_scalars(tmp_path / "tensorboard")["loss"] == {
        r["step"]: pytest.approx(r["loss"], rel=1e-6) for r in read_metrics(tmp_path / "metrics.jsonl")[0]}


@pytest.mark.timeout(120)
def test_wandb_offline_run_holds_every_scalar_and_resumes_the_same_run(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    _run(tmp_path, ("wandb",))
    expected = _expected(tmp_path)
    (first,) = wandb_runs(tmp_path)
    time.sleep(1.1)  # W&B names a run's folder by the second it started (and its id, the same for the resume)
    _run(tmp_path, ("wandb",), steps=range(6, 11), resume_step=5)
    runs = wandb_runs(tmp_path)
    assert [r["folder"] for r in runs[:1]] == [first["folder"]] and len(runs) == 2
    assert runs[0]["id"] == runs[1]["id"] == json.loads((tmp_path / "trackers.json").read_text())["wandb"]["id"]
    assert runs[0]["config"]["lr"] == 0.003 and runs[1]["config"]["corpus"] == {"bytes": 300000}
    rows = {row["step"]: row for row in first["history"]}
    assert sorted(rows) == list(range(0, 9))  # one row per step: a step's training and evaluation records
    for name, by_step in expected.items():
        assert {s: rows[s][name] for s in by_step} == by_step, name
    assert rows[8][f"{trackers.PLOT_TAG}/_type"] == "image-file"  # the plot, its PNG in the run's files
    assert (first["folder"] / "files" / rows[8][f"{trackers.PLOT_TAG}/path"]).stat().st_size > 0
    assert [row["step"] for row in runs[1]["history"]] == [6, 7, 8, 9, 10]  # the same axis, on from the checkpoint
    assert runs[1]["history"][0]["resumed_from_step"] == 5
    assert any(kind == "exit" for kind, _ in wandb_records(next(runs[1]["folder"].glob("*.wandb"))))


@pytest.mark.timeout(120)
def test_trackio_local_run_holds_every_scalar_and_resumes_the_same_run(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    if "trackio" not in sys.modules:  # trackio reads its folder once; the tracker puts it under OUT if it can
        monkeypatch.delenv("TRACKIO_DIR", raising=False)
    _run(tmp_path, ("trackio",))
    expected = _expected(tmp_path)
    entry, rows, config = trackio_logs(tmp_path)
    if entry["dir"] != str((tmp_path / "trackio").resolve()):
        assert "trackio" in sys.modules  # only when another test imported it first
    assert config["lr"] == 0.003 and config["corpus"] == {"bytes": 300000}
    scalars = [r for r in rows if trackers.PLOT_TAG not in r]
    for name, by_step in expected.items():
        assert {r["step"]: r[name] for r in scalars if name in r} == by_step, name
    assert [r["step"] for r in rows if trackers.PLOT_TAG in r] == [8]
    _run(tmp_path, ("trackio",), steps=range(6, 11), resume_step=5)
    entry_after, rows_after, _ = trackio_logs(tmp_path)
    assert entry_after["name"] == entry["name"]  # the same run
    assert [r["step"] for r in rows_after if "loss" in r] == [*range(1, 9), *range(6, 11)]  # appended


def test_run_events_from_records_and_the_ft_report() -> None:
    train = [{"step": s, "loss": 1.0, "outer_synced": [0] if s % 3 == 0 else [],
              "ft_participants": {4: 1, 5: 1, 6: 1}.get(s, 2)} for s in range(1, 10)]
    train[6]["resumed_from_step"] = 5  # step 7: the first after a resume from step 5
    ft = {"discarded": [{"step": 4, "participants": 2, "at_s": 1.0}], "recoveries": [{"step": 7, "bytes": 10,
                                                                                     "seconds": 0.1}]}
    events = run_events(train, ft)
    assert events == {"outer_sync": [3, 6, 9], "group_lost": [4], "group_joined": [7], "discarded": [4],
                      "recovered": [7], "resumed": [5]}
    assert run_events(train)["discarded"] == [] and all(not steps for steps in run_events(train[:2]).values())


def test_plot_draws_validation_and_every_event(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path)
    log.log_val(**_val(0))
    for step in range(1, 9):
        log.log_train(**{**_train(step), "ft_participants": 1 if step in (3, 4) else 2})
    ft = {"discarded": [{"step": 3, "participants": 2, "at_s": 1.0}],
          "recoveries": [{"step": 5, "bytes": 10, "seconds": 0.1}]}
    resumed = MetricsLog(tmp_path, resume_step=6)
    for step in range(7, 9):
        resumed.log_train(**_train(step))
    resumed.log_val(**_val(8))
    fig = plot_losses(resumed, tmp_path / "loss.png", ft=ft)
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert list(lines["val"].get_xdata()) == [0, 8] and list(lines["val"].get_ydata()) == [6.0, 6.0 / 9]
    assert list(lines["train"].get_xdata()) == list(range(1, 9))
    assert list(lines[EVENTS["outer_sync"][0]].get_xdata()) == [4, 8]
    assert list(lines[EVENTS["outer_sync"][0]].get_ydata()) == [5.0 / 4, 5.0 / 8]  # on the training curve
    assert list(lines[EVENTS["discarded"][0]].get_xdata()) == [3]

    def vertical(key: str) -> list[float]:
        color = EVENTS[key][1]["color"]
        return sorted(line.get_xdata()[0] for line in ax.get_lines()
                      if line.get_color() == color and line.get_linestyle() == EVENTS[key][1]["ls"]
                      and list(line.get_xdata()) == [line.get_xdata()[0]] * 2)

    assert vertical("group_lost") == [3] and vertical("group_joined") == [5]
    assert vertical("recovered") == [5] and vertical("resumed") == [6]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert [label for label, _ in EVENTS.values() if label not in legend] == []
    assert (tmp_path / "loss.png").stat().st_size > 0
    (tmp_path / "plain").mkdir()
    plain = MetricsLog(tmp_path / "plain")  # a run without events: none drawn
    for step in range(1, 4):
        plain.log_train(**{k: v for k, v in _train(step).items() if k not in ("outer_synced", "ft_participants")})
    fig = plot_losses(plain, tmp_path / "plain" / "loss.png")
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["train"]
