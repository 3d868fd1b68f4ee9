"""The training job's configuration in one process: the flags generated from JobConfig, their checks (including
those against the world size and the file system, `check_run`), the ep / outer defaults, the learning-rate schedule
and the weight-decay rule by parameter name (`no_decay`, which tests/reference.py uses too). Whole runs are in
tests/integration/test_train.py."""

from pathlib import Path

import pytest

from shardfusion.train.config import (DEFAULT_WARMUP, SLOW_ATTENTION_FLOPS, JobConfig, attention_flops,
                                      build_parser, check_run, lr_at, parse_args, resolve, seq_len_warning)
from shardfusion.train.launch import WORKERS_PER_CORE, nproc_warning
from shardfusion.train.data import DATA_ORDER, DATA_ORDER_PER_RANK, min_corpus_bytes
from shardfusion.train.optim import no_decay
from shardfusion.train.resume import layout_note, saved_data_order

USAGE_ERROR = "shardfusion-train: error: "


def flag_error(capsys: pytest.CaptureFixture, args: list[str]) -> str:
    """The error that parse_args prints for args, after checking that it exits with status 2 and that its whole
    output is that one line (no usage block before it)."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(args)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith(USAGE_ERROR), err
    return err.strip().removeprefix(USAGE_ERROR)


def test_check_run_messages(tmp_path: Path) -> None:
    need = min_corpus_bytes(64)  # tiny: seq_len 64
    (tmp_path / "corpus.txt").write_bytes(b"x" * need)
    (tmp_path / "short.txt").write_bytes(b"x" * (need - 1))

    def check(world_size: int = 4, **fields) -> None:
        fields = {"data": str(tmp_path / "corpus.txt"), "out": str(tmp_path / "run"), **fields}
        config = resolve(JobConfig.from_flat(preset="tiny", **fields), device="cpu", world_size=world_size,
                         world=f"--nproc {world_size}")
        check_run(config, world=f"--nproc {world_size}")

    check()
    check(world_size=8, fsdp_outer_degree=4)
    with pytest.raises(ValueError, match=r"--fsdp-outer-degree 3 does not fit 4 ranks \(--nproc 4\).*"
                                         r"fsdp_outer_degree\(3\)"):
        check(fsdp_outer_degree=3)
    with pytest.raises(ValueError, match=r"fsdp_outer_degree\(0\) must be >= 1"):
        check(fsdp_outer_degree=0)
    with pytest.raises(ValueError, match=rf"--data-bytes {need - 1} is too small.*--data-bytes >= {need}"):
        check(data_bytes=need - 1)
    with pytest.raises(ValueError, match="--data-bytes 1000 is too small: it splits into 950 train / 50 val"):
        check(data_bytes=1000)
    with pytest.raises(ValueError, match=rf"--data .*short.txt holds only {need - 1} bytes.*"
                                         rf"split into {need - 1 - 64} train / 64 val"):
        check(data=str(tmp_path / "short.txt"))
    with pytest.raises(ValueError, match="^--data .* is neither a file nor a folder$"):
        check(data=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="^--data .*empty holds no bytes; pass --data with a non-empty"):
        check(data=str(tmp_path / "empty"))
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="^--data .*empty.txt holds no bytes"):
        check(data=str(tmp_path / "empty.txt"))
    with pytest.raises(ValueError, match="--out .* is not a folder"):
        check(out=str(tmp_path / "corpus.txt" / "run"))

    # Expert parallelism: ep must divide the sharding degree, and ep * fsdp_outer_degree must divide it too.
    check(world_size=8, experts=8, ep=4)
    check(world_size=8, experts=4, ep=2, fsdp_outer_degree=4)
    with pytest.raises(ValueError, match=r"^--ep 8 with --fsdp-outer-degree 2 does not fit 4 ranks \(--nproc 4\): "
                                         r"sharding\(4\) % ep\(8\)"):
        check(experts=8, ep=8, fsdp_outer_degree=2)
    with pytest.raises(ValueError, match=r"^--ep 4 with --fsdp-outer-degree 2 does not fit 4 ranks \(--nproc 4\): "
                                         r"moe_sharding\(1\) .* % fsdp_outer_degree\(2\)"):
        check(experts=4, ep=4, fsdp_outer_degree=2)


def test_resolve_ep_and_outer_defaults() -> None:
    def resolved(world_size: int, **fields) -> tuple[int, int]:
        config = resolve(JobConfig.from_flat(**fields), device="cpu", world_size=world_size)
        return config.ep, config.fsdp_outer_degree

    assert resolved(4) == (2, 2)  # the default job: ep 2, HSDP outer 2
    assert resolved(2) == (2, 1)
    assert resolved(1) == (1, 1)
    assert resolved(8) == (2, 2)
    assert resolved(4, experts=0) == (1, 2)
    assert resolved(4, experts=3) == (1, 2)
    assert resolved(4, ep=4) == (4, 1)  # moe_sharding 1: no room for 2 replicas
    assert resolved(6) == (2, 1)  # moe_sharding 3 is odd
    assert resolved(4, ep=3, experts=3) == (3, 2)  # ep does not fit; check_run says so, not resolve


def test_batch_flags_per_rank_and_global(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    def sizes(world_size: int, saved: dict | None = None, **fields) -> tuple[int | None, int | None]:
        config = resolve(JobConfig.from_flat(**fields), device="cpu", world_size=world_size, saved=saved)
        return config.batch_size, config.global_batch_size

    assert sizes(4) == (16, 64)  # neither flag: 16 per data-parallel rank
    assert sizes(4, batch_size=3) == (3, 12)
    assert sizes(4, global_batch_size=8) == (2, 8)
    assert sizes(2, batch_size=4, global_batch_size=8) == (4, 8)  # both, consistent
    with pytest.raises(ValueError, match=r"^--global-batch-size 8 is not divisible .* 3 \(3 ranks\)"):
        sizes(3, global_batch_size=8)  # does not divide: resolve refuses it (more below)
    # a resume without batch flags keeps the saved G (per-rank B recomputed), or an older run's per-rank B
    assert sizes(2, saved={"global_batch_size": 8, "data_order": 2}) == (4, 8)
    assert sizes(2, saved={"batch_size": 4, "data_order": 1}) == (4, 8)
    assert sizes(2, saved={"global_batch_size": 8}, batch_size=2) == (2, 4)  # a flag wins; restore names the change
    assert flag_error(capsys, ["--global-batch-size", "0"]) == "--global-batch-size must be >= 1, got 0"
    assert flag_error(capsys, ["--batch-size", "0"]) == "--batch-size must be >= 1, got 0"

    (tmp_path / "corpus.txt").write_bytes(b"x" * min_corpus_bytes(64))  # tiny: seq_len 64

    def check(world_size: int, **fields) -> None:
        config = resolve(JobConfig.from_flat(preset="tiny", data=str(tmp_path / "corpus.txt"), out=str(tmp_path / "run"),
                                     **fields), device="cpu", world_size=world_size, world=f"--nproc {world_size}")
        check_run(config, world=f"--nproc {world_size}")

    check(4, global_batch_size=8)
    check(4, batch_size=2, global_batch_size=8)
    with pytest.raises(ValueError, match=r"^--global-batch-size 10 is not divisible by the data-parallel world size "
                                         r"4 \(--nproc 4\).*use --global-batch-size 8 or 12"):
        check(4, global_batch_size=10)
    with pytest.raises(ValueError, match=r"^--global-batch-size 2 is not divisible by .* size 4 .* "
                                         r"--global-batch-size 4, or"):
        check(4, global_batch_size=2)
    with pytest.raises(ValueError, match=r"^--batch-size 4 \(per data-parallel rank\) and --global-batch-size 8 "
                                         r"disagree: 4 x the data-parallel world size 4 \(--nproc 4\) = 16"):
        check(4, batch_size=4, global_batch_size=8)


def test_saved_data_order() -> None:
    assert saved_data_order({"step": 3, "config": {"batch_size": 4}}) == DATA_ORDER_PER_RANK  # written before it
    assert saved_data_order({"step": 3, "data_order": DATA_ORDER}) == DATA_ORDER
    with pytest.raises(ValueError, match=r"records data order 9, but this version knows only \(1, 2\)"):
        saved_data_order({"data_order": 9})


EP2 = "; ep2 (moe_sharding{} = outer{} x expert_inner1)"
PP2 = "world 4 = dp1 x pp2 x sharding2 (outer1 x inner2) x sep1 x cp1 x mp1" + EP2.format(1, 1)
PP1 = "world 2 = dp1 x pp1 x sharding2 (outer1 x inner2) x sep1 x cp1 x mp1" + EP2.format(1, 1)
HSDP = "world 4 = dp1 x pp1 x sharding4 (outer2 x inner2) x sep1 x cp1 x mp1" + EP2.format(2, 2)


def test_resume_in_another_layout_names_the_degrees_that_changed() -> None:
    """`restore`'s note (`layout_note`) on a resume across --pp, --fsdp-outer-degree, ...: the flags and their
    values, not only the world size (the layout lines are `Topology.describe`'s)."""
    saved = {"world_size": 4, "layout": PP2}
    assert layout_note(saved, 2, PP1, DATA_ORDER) == (
        "world size was 4, now 2: sums in another order, fresh RNG states on new ranks (--pp 2 -> 1)")
    assert layout_note(saved, 4, HSDP, DATA_ORDER) == (
        f"layout was {PP2}, now {HSDP}: sums in another order (--pp 2 -> 1, --fsdp-outer-degree 1 -> 2)")
    assert layout_note({"world_size": 4, "layout": HSDP}, 2, PP1, DATA_ORDER_PER_RANK) == (
        "world size was 4, now 2: other data order (a checkpoint of the per-rank data order), fresh RNG states on "
        "new ranks (--fsdp-outer-degree 2 -> 1)")
    assert layout_note(saved, 4, PP2, DATA_ORDER) is None
    old = "world 4 = dp1 x sharding4 (outer2 x inner2)"  # a layout line before pp existed: nothing to compare
    assert layout_note({"world_size": 4, "layout": old}, 4, HSDP, DATA_ORDER).endswith("sums in another order")


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """argparse's own errors and the job's checks: one `USAGE_ERROR` line, exit status 2, nothing before it (the
    usage block is --help's); also those raised after parsing, before any worker starts (`main`'s preflight)."""
    assert flag_error(capsys, ["--no-such-flag"]) == "unrecognized arguments: --no-such-flag"
    assert flag_error(capsys, ["--steps", "x"]) == "argument --steps: invalid int value: 'x'"
    assert flag_error(capsys, ["--steps"]) == "argument --steps: expected one argument"
    assert flag_error(capsys, ["--fsdp-outer-degree", "x"]).startswith("argument --fsdp-outer-degree: expected")
    assert flag_error(capsys, ["--preset", "huge"]).startswith("--preset 'huge' is unknown")
    from shardfusion.train.job import main
    with pytest.raises(SystemExit) as exit_info:
        main(["--preset", "tiny", "--nproc", "3", "--fsdp-outer-degree", "2", "--out", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(USAGE_ERROR + "--fsdp-outer-degree 2 does not fit 3 ranks (--nproc 3)"), err
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("usage: shardfusion-train")


def test_moe_flags_rejected(capsys: pytest.CaptureFixture) -> None:
    assert flag_error(capsys, ["--experts", "2", "--top-k", "3"]) == "--top-k 3 must be between 1 and --experts 2"
    assert flag_error(capsys, ["--experts", "4", "--top-k", "0"]) == "--top-k 0 must be between 1 and --experts 4"
    assert flag_error(capsys, ["--experts", "6", "--ep", "4"]).startswith("--ep 4 must divide --experts 6")
    assert flag_error(capsys, ["--experts", "0", "--ep", "2"]).startswith("--ep 2 needs experts")
    assert flag_error(capsys, ["--experts", "-1"]) == "--experts must be >= 0, got -1"
    assert flag_error(capsys, ["--ep", "0"]) == "--ep must be >= 1, got 0"
    assert flag_error(capsys, ["--expert-policy", "all"]).startswith("--expert-policy must be replicate or shard")
    assert flag_error(capsys, ["--aux-loss-coef", "-0.1"]) == "--aux-loss-coef must be >= 0, got -0.1"


@pytest.mark.parametrize("flag", ["--weight-decay", "--aux-loss-coef", "--clip", "--lr", "--min-lr", "--dropout"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_float_flags_rejected(flag: str, value: str, capsys: pytest.CaptureFixture) -> None:
    # nan would train a NaN run with exit status 0 (or, for --clip, silently turn clipping off)
    assert flag_error(capsys, [flag, value]) == f"argument {flag}: expected a finite number, got {value!r}"


def test_config_refuses_non_finite_floats() -> None:
    with pytest.raises(ValueError, match="^--clip must be a finite number, got nan$"):
        JobConfig.from_flat(clip=float("nan")).validate()


def test_abbreviated_flags_and_zero_steps_rejected(capsys: pytest.CaptureFixture) -> None:
    assert flag_error(capsys, ["--step", "2"]) == "unrecognized arguments: --step 2"
    assert flag_error(capsys, ["--steps", "0"]) == "--steps must be >= 1, got 0"


def test_ranks_per_node_flag(capsys: pytest.CaptureFixture) -> None:
    assert parse_args(["--ranks-per-node", "8"]).run.ranks_per_node == 8
    assert parse_args([]).run.ranks_per_node is None  # LOCAL_WORLD_SIZE at run time
    assert flag_error(capsys, ["--ranks-per-node", "0"]) == "--ranks-per-node must be >= 1, got 0"


def test_ranks_per_node_against_the_world(tmp_path: Path) -> None:
    # The topology's ranks_per_node: the flag, one node when it is the world or more, None (LOCAL_WORLD_SIZE) without
    # it; a value below the world that does not divide it is refused before any worker starts.
    from shardfusion.train.parallelize import topology_ranks_per_node

    def checked(rpn: int | None) -> int | None:
        config = resolve(JobConfig.from_flat(preset="tiny", out=str(tmp_path / "run"), ranks_per_node=rpn),
                         device="cpu", world_size=4, world="--nproc 4")
        check_run(config, world="--nproc 4")
        return topology_ranks_per_node(config.run, 4)

    assert [checked(rpn) for rpn in (None, 1, 2, 4, 8)] == [None, 1, 2, 4, 4]
    with pytest.raises(ValueError) as error:
        checked(3)
    assert str(error.value) == ("--ranks-per-node 3 must divide the 4 ranks (--nproc 4): nodes of equal size (or 4 "
                                "or more: one node)")


def test_cli_is_generated_from_the_dataclass() -> None:
    parser = build_parser()
    help_text = parser.format_help()
    for flag in ("--preset", "--n-layer", "--d-model", "--n-head", "--seq-len", "--batch-size", "--global-batch-size",
                 "--grad-accum", "--steps", "--lr", "--min-lr", "--warmup", "--weight-decay", "--clip", "--seed",
                 "--fsdp-outer-degree", "--reshard-policy", "--eval-every", "--eval-batches", "--nproc", "--data",
                 "--out", "--sample-tokens", "--device", "--experts", "--top-k", "--ep", "--expert-hidden",
                 "--aux-loss-coef", "--expert-policy", "--ranks-per-node", "--hf-model", "--init-from"):
        assert flag in help_text
    assert "Max global gradient norm" in help_text  # field docstrings become the help
    config = parse_args(["--steps", "7", "--lr", "0.01", "--min-lr", "0.001", "--no-progress"])
    assert (config.schedule.steps, config.optim.lr, config.run.progress) == (7, 0.01, False)
    assert parse_args([]) == JobConfig()
    assert config.model_config().n_layer == 4
    default = JobConfig().model_config()  # the default job is a GPT-MoE
    assert (default.n_experts, default.top_k, default.expert_hidden_size) == (4, 2, 256)
    dense = parse_args(["--experts", "0"]).model_config()
    assert dense.n_experts == 0
    moe = parse_args(["--preset", "tiny", "--experts", "8", "--top-k", "1", "--expert-hidden", "32"]).model_config()
    assert (moe.n_experts, moe.top_k, moe.expert_hidden_size, moe.d_model) == (8, 1, 32, 64)
    assert parse_args(["--preset", "tiny", "--n-layer", "3"]).model_config().n_layer == 3
    with pytest.raises(SystemExit):
        parse_args(["--preset", "nonexistent"])
    with pytest.raises(SystemExit):
        parse_args(["--lr", "0.001", "--min-lr", "0.01"])


def test_lr_schedule() -> None:
    config = JobConfig.from_flat(steps=100, warmup=10, lr=1.0, min_lr=0.1)
    lrs = [lr_at(config, s) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_warmup_longer_than_the_run_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    assert flag_error(capsys, ["--warmup", "500", "--steps", "1"]) == (
        "--warmup 500 must be between 0 and --steps 1: the learning rate rises linearly over the warm-up steps, and "
        "a longer warm-up would end the run before it reaches --lr; use --warmup 1 or less (0: none)")
    assert flag_error(capsys, ["--warmup", "-1"]).startswith("--warmup -1 must be between 0 and --steps 200")
    assert parse_args(["--warmup", "5", "--steps", "5"]).schedule.warmup == 5  # ends at --lr on the last step

    def warmup(saved=None, **fields) -> int:
        return resolve(JobConfig.from_flat(**fields), device="cpu", world_size=4, saved=saved).warmup

    # not given: DEFAULT_WARMUP, at most --steps; a resumed run keeps the saved one (at most --steps too)
    assert DEFAULT_WARMUP == 20
    assert (warmup(), warmup(steps=3), warmup(steps=3, warmup=0)) == (20, 3, 0)
    assert (warmup(saved={"warmup": 7}), warmup(saved={"warmup": 7}, steps=5), warmup(saved={"warmup": 7}, warmup=2)) \
        == (7, 5, 2)
    assert lr_at(JobConfig.from_flat(steps=4, lr=1.0), 0) == pytest.approx(0.25)  # unresolved: the same warm-up of 4 steps


def test_nproc_above_the_cores_warns() -> None:
    assert WORKERS_PER_CORE == 2
    assert nproc_warning(64, "cpu", 2) == (
        "--nproc 64 starts 64 CPU workers on 2 cores (32 per core): each gets a sliver of a core, start-up and every "
        "collective wait for the slowest, and memory holds 64 copies of torch; the run is slower than with 4 or "
        "fewer (--nproc 4)")
    assert nproc_warning(5, "cpu", 2, "--nproc-per-node").startswith("--nproc-per-node 5 starts 5 CPU workers on 2")
    assert nproc_warning(4, "cpu", 2) is None  # the default run on two cores
    assert nproc_warning(64, "cuda", 2) is None  # one worker per GPU, checked against the GPUs


def test_seq_len_too_long_warns_and_one_the_corpus_cannot_serve_is_an_error(tmp_path: Path) -> None:
    def config(device: str = "cpu", **fields) -> JobConfig:
        return resolve(JobConfig.from_flat(**fields), device=device, world_size=4)

    long = config(seq_len=100_000)  # small preset: 4 layers of width 128, 16 sequences per rank
    assert attention_flops(long) == pytest.approx(6 * 4 * 100_000 ** 2 * 128 * 16)
    assert seq_len_warning(long) == (
        "--seq-len 100000: the attention alone needs about 4.9e+14 FLOPs per rank per optimizer step (6 x n_layer 4 "
        "x seq_len^2 x d_model 128 x 16 sequences x --grad-accum 1), above 1e+12 on cpu: expect a slow run (it "
        "grows with the square of --seq-len); --seq-len 4096 or less stays under it")
    assert attention_flops(config(seq_len=4096)) < SLOW_ATTENTION_FLOPS["cpu"] < attention_flops(config(seq_len=8192))
    assert seq_len_warning(config(seq_len=4096)) is None and seq_len_warning(config()) is None
    assert seq_len_warning(config("cuda", seq_len=8192)) is None  # a GPU does 1e12 FLOPs in well under a second
    assert attention_flops(config(seq_len=8192, cp=2, mp=2)) == attention_flops(config(seq_len=8192)) / 4
    # impossible: each split of the corpus must hold one window of seq_len + 1 bytes (check_run, before launch)
    with pytest.raises(ValueError, match=r"^--data-bytes 16000000 is too small: .* each split needs seq_len \+ 1 = "
                                         r"1000001 bytes; use --data-bytes >= 20000020 or a smaller --seq-len$"):
        check_run(config(seq_len=1_000_000), world="--nproc 4")
    (tmp_path / "corpus.txt").write_bytes(b"x" * 1000)
    with pytest.raises(ValueError, match=r"holds only 1000 bytes, which split into 950 train / 50 val bytes, but "
                                         r"each split needs seq_len \+ 1 = 129 bytes"):
        check_run(config(data=str(tmp_path / "corpus.txt")), world="--nproc 4")


def test_checkpoint_flags_rejected(capsys: pytest.CaptureFixture) -> None:
    assert flag_error(capsys, ["--keep", "0"]) == (
        "--keep must be >= 1 (the latest checkpoint is always kept), got 0")
    assert flag_error(capsys, ["--save-every", "-1"]) == "--save-every must be >= 0, got -1"
    assert flag_error(capsys, ["--max-restarts", "-2"]) == "--max-restarts must be >= 0, got -2"
    assert flag_error(capsys, ["--steps", "10", "--stop-after", "11"]) == (
        "--stop-after must be between 1 and --steps 10, got 11")
    assert flag_error(capsys, ["--stop-after", "0"]).startswith("--stop-after must be between 1 and --steps")
    assert flag_error(capsys, ["--max-restarts", "1"]).startswith("--max-restarts 1 needs --save-every > 0")


@pytest.mark.parametrize("name, exempt", [
    ("wte.weight", True), ("wpe.weight", True), ("ln_f.weight", True), ("blocks.0.ln_1.bias", True),
    ("blocks.0.attn.qkv.bias", True), ("blocks.3.mlp.fc.weight", False), ("blocks.0.attn.proj.weight", False),
    ("encoder.layernorm.weight", True), ("lm_head.weight", False), ("blocks.0.mlp.router.weight", False),
    ("blocks.1.mlp.experts.3.fc.weight", False), ("blocks.1.mlp.experts.3.proj.bias", True),
    # Hugging Face names (--hf-model): norms, embeddings and biases are exempt; matrices, routers, fused experts and
    # an untied head decay
    ("model.embed_tokens.weight", True), ("model.norm.weight", True), ("model.layers.0.input_layernorm.weight", True),
    ("model.layers.1.post_attention_layernorm.weight", True), ("model.layers.0.self_attn.q_norm.weight", True),
    ("model.layers.0.self_attn.q_proj.bias", True), ("model.layers.0.self_attn.o_proj.weight", False),
    ("model.layers.0.mlp.gate_proj.weight", False), ("model.layers.0.mlp.gate.weight", False),
    ("model.layers.0.mlp.experts.gate_up_proj", False), ("model.layers.0.mlp.experts.down_proj", False),
])
def test_weight_decay_groups_by_name(name: str, exempt: bool) -> None:
    assert no_decay(name) is exempt


def test_preflight_prints_the_warnings_before_any_worker_starts(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from shardfusion.train import job

    monkeypatch.setattr(job, "cpu_cores", lambda: 2)
    config = job.preflight(parse_args(["--nproc", "64", "--seq-len", "100000", "--device", "cpu",
                                       "--out", str(tmp_path / "run")]), torchrun=False)
    assert (config.nproc, config.warmup) == (64, 20)
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0:2] for line in printed] == [["shardfusion", " warning"]] * 2, printed
    assert printed[0].startswith("shardfusion: warning: --nproc 64 starts 64 CPU workers on 2 cores")
    assert printed[1].startswith("shardfusion: warning: --seq-len 100000: the attention alone needs about 4.9e+14")
