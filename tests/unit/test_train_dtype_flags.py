"""The training job's dtype flags (shardfusion/train/dtype_flags.py) in one process: every documented value of
--param-dtype, --grad-comm-dtype, --outer-comm-dtype and --all-gather-dtype (README.md, docs/slow-links.md,
docs/compressed-all-reduce.md, docs/quantized-all-gather.md, docs/quantized-reduce-scatter.md) in every mode, through
the job's own path: the command line (`parse_args`), the checks against the world size (`resolve`, `check_run`), and
the arguments the workers hand to the library (`dtype_flags.mixed_precision`, `dtype_flags.outer_comm_dtype`; with
--outer-sync diloco `job_outer.OuterRun`'s `DiLoCo`, with --dry-run `job_dry_run.run`'s `sf.dry_run`), compared with
torch's dtypes written out here. A mode that refuses a value says so in one usage-error line. A whole DiLoCo run with
--outer-comm-dtype bf16: tests/integration/test_train_diloco.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardfusion as sf
from shardfusion._runtime.compress import validate_outer_comm_dtype
from shardfusion.policies import (ALL_GATHER_DTYPE_NAMES, DTYPE_NAMES, GRAD_COMM_DTYPE_NAMES, MixedPrecisionPolicy,
                                  dtype_named, dtype_names)
from shardfusion.train import dtype_flags, job_dry_run, job_outer
from shardfusion.train.config import check_run, parse_args, resolve

USAGE_ERROR = "shardfusion-train: error: "

MEANS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": "int8",
         "fp8": torch.float8_e4m3fn}
"""What each documented value stands for (torch's dtypes, written out: the reference)."""

DOCUMENTED = {"--param-dtype": ("fp32", "bf16", "fp16"), "--grad-comm-dtype": ("fp32", "bf16", "fp16", "int8"),
              "--outer-comm-dtype": ("fp32", "bf16", "fp16", "int8"),
              "--all-gather-dtype": ("int8", "bf16", "fp16", "fp8")}

LIGHTHOUSE = ["--ft-lighthouse", "http://127.0.0.1:29510", "--ft-replicas", "2", "--ft-replica-id", "0"]
MODES = {  # mode: (its flags, world size)
    "hsdp": (["--fsdp-outer-degree", "2"], 4),
    "fsdp-tp": (["--mp", "2", "--experts", "0"], 4),
    "diloco": (["--fsdp-outer-degree", "2", "--outer-sync", "diloco", "--outer-every", "4"], 4),
    "streaming-diloco": (["--fsdp-outer-degree", "2", "--outer-sync", "diloco", "--outer-every", "4",
                          "--outer-fragments", "2"], 4),
    "pp": (["--pp", "2"], 4),
    "ft": (LIGHTHOUSE, 2),
    "dry-run": (["--dry-run", "--world", "16", "--ranks-per-node", "8"], 16),
}
REFUSED = {("ft", "--outer-comm-dtype"): "--outer-comm-dtype {value} with --ft-lighthouse: "}
"""(mode, flag): the start of the one error line for every value of that flag."""

GRID = [(mode, flag, value) for mode in MODES for flag, values in DOCUMENTED.items() for value in values]


def _one_error_line(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """The usage error of ``argv``: exit status 2 and one line on stderr (returned without its prefix)."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(USAGE_ERROR)]
    assert len(lines) == 1, err
    return lines[0].removeprefix(USAGE_ERROR)


@pytest.mark.parametrize("mode, flag, value", GRID)
def test_every_documented_value_in_every_mode(mode: str, flag: str, value: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    extra, world = MODES[mode]
    argv = ["--preset", "tiny", "--out", str(tmp_path / "run"), *extra, flag, value]
    if (mode, flag) in REFUSED:
        line = _one_error_line(capsys, argv)
        assert line.startswith(REFUSED[mode, flag].format(value=value)), line
        return
    config = parse_args(argv)
    if mode == "dry-run":
        config, world, _ = job_dry_run.prepare(config)
    else:
        config = resolve(config, device="cpu", world_size=world)
        check_run(config, world=f"--nproc {world}")
    policy, wire = dtype_flags.mixed_precision(config.precision), dtype_flags.outer_comm_dtype(config.precision)
    param = MEANS[value] if flag == "--param-dtype" else torch.float32  # --param-dtype's default is fp32
    comm = MEANS[value] if flag == "--grad-comm-dtype" else None
    gather = MEANS[value] if flag == "--all-gather-dtype" else None
    assert (policy.param_dtype, policy.grad_comm_dtype, policy.all_gather_dtype) == (param, comm, gather), (flag, value)
    assert wire == (MEANS[value] if flag == "--outer-comm-dtype" else None)
    assert validate_outer_comm_dtype(wire) == wire  # as fully_shard and DiLoCo take it

    seen: dict = {}
    if "diloco" in mode:  # what the job builds its DiLoCo with (job_outer.OuterRun), the engine itself stubbed

        class Recorder:
            def __init__(self, model, topo, **kwargs) -> None:
                seen.update(kwargs)
                self.replica_group = None

        monkeypatch.setattr(job_outer, "DiLoCo", Recorder)
        job_outer.OuterRun(config.outer, config.precision, config.schedule.steps, model=None, topo=None, optimizers=[])
        assert seen["comm_dtype"] == wire and seen["fragments"] == config.outer.outer_fragments
    if mode == "dry-run":  # what the dry run hands sf.dry_run, which is stubbed: nothing is played
        seen = dry_run_fully_shard(argv, monkeypatch)
        assert seen["mp_policy"] == policy and seen["outer_comm_dtype"] == wire


def dry_run_fully_shard(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> dict:
    """The `fully_shard` keywords the job's dry run (`job_dry_run.run`) hands `sf.dry_run` for ``argv``; `sf.dry_run`
    is stubbed, so nothing is played."""
    seen: dict = {}

    def record(build, step, **kwargs):
        seen.update(kwargs["fully_shard"])
        raise StopIteration

    monkeypatch.setattr(sf, "dry_run", record)
    with pytest.raises(StopIteration):
        job_dry_run.run(parse_args(argv))
    return seen


def test_one_table_of_names() -> None:
    """The library's names (`shardfusion.policies`), which the job's flags take, and torch's own names."""
    assert DTYPE_NAMES == {k: v for k, v in MEANS.items() if k not in ("int8", "fp8")}
    assert ALL_GATHER_DTYPE_NAMES == {k: MEANS[k] for k in DOCUMENTED["--all-gather-dtype"]}
    assert dtype_names() == ("fp32", "bf16", "fp16", "float32", "bfloat16", "float16")
    for short, full in (("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")):
        assert dtype_named(short) is dtype_named(full) is getattr(torch, full)
    for bad in ("int8", "BF16", "torch.bfloat16", None, torch.bfloat16):
        with pytest.raises(ValueError, match=r"unknown dtype name .*: expected one of fp32, bf16, fp16, float32"):
            dtype_named(bad)
    assert MixedPrecisionPolicy(param_dtype=dtype_named("bf16")).param_dtype is torch.bfloat16
    assert dtype_flags.VALUES["outer_comm_dtype"] == ("fp32", "bf16", "fp16", "int8")
    assert dtype_flags.VALUES["all_gather_dtype"] == ("int8", "bf16", "fp16", "fp8")
    assert GRAD_COMM_DTYPE_NAMES == {k: MEANS[k] for k in DOCUMENTED["--grad-comm-dtype"]}
    assert dtype_flags.VALUES["grad_comm_dtype"] == ("fp32", "bf16", "fp16", "int8")


@pytest.mark.parametrize("flag", list(DOCUMENTED))
def test_undocumented_values_are_one_line(flag: str, capsys: pytest.CaptureFixture) -> None:
    accepted = ", ".join(DOCUMENTED[flag])
    for value in ("bfloat16", "int4"):
        line = _one_error_line(capsys, ["--preset", "tiny", flag, value])
        assert line == f"{flag} must be one of {accepted}, got {value!r}", line
