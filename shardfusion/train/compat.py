"""Which of the training job's modes combine: one table, data only, of every unordered pair of modes.

Each pair is either `Works` (with the pytest node id of the test that runs the pair and shows it right) or `Refused`
(with the reason): no third kind; a new mode comes with an entry of one of the two for each of its pairs. The
job's refusal messages come from here: a flag check that refuses a pair calls `refuse` (or `refuse_first`), which
raises ``"<flag> <value> with <flag> <value>: <reason>"``. tests/unit/test_compat.py checks that the table covers
every pair once, that every named test exists, and that every refused pair is refused by the job's own flag checks
with the table's reason; docs/compatibility.md is rendered from it (``python -m shardfusion.train.compat
--markdown``).

The modes are the job's switches, not its sub-options: --ep > 1 is expert parallel, while --expert-policy shard (which
DiLoCo refuses) is a choice inside it; --fsdp-outer-degree auto is no degree yet, and the checks that refuse it
(with --pp, --mp, --cp) are about the cost model, not about a pair of modes. The topology's sep axis (sequence
parallel of the library, `shardfusion.topology`) has no flag in the job: context parallel is --cp alone.

To change a pair (say a refusal is lifted): replace its entry in `PAIRS` with ``Works("tests/...::test_name")`` and
delete the check that refused it; the unit test then fails until the check is gone.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from typing import NoReturn


@dataclass(frozen=True)
class Mode:
    """One switch of the job."""

    flag: str
    """How the mode is switched on, e.g. ``--pp > 1``."""
    what: str
    """What it does, a few words."""
    doc: str
    """The docs page that tells its story (docs/...)."""


MODES: dict[str, Mode] = {
    "pp": Mode("--pp > 1", "pipeline stages", "docs/train-pipeline.md"),
    "mp": Mode("--mp > 1", "tensor parallel", "docs/tensor-parallel.md"),
    "cp": Mode("--cp > 1", "context parallel", "docs/context-parallel.md"),
    "ep": Mode("--ep > 1", "expert parallel (GPT-MoE)", "docs/design.md"),
    "hsdp": Mode("--fsdp-outer-degree > 1", "HSDP replicas", "docs/design.md"),
    "diloco": Mode("--outer-sync diloco", "DiLoCo outer steps", "docs/slow-links.md"),
    "ft": Mode("--ft-lighthouse", "fault-tolerant replica groups (torchft)", "docs/fault-tolerance.md"),
    "muon": Mode("--optimizer muon", "Muon on whole matrices", "docs/train-muon.md"),
    "hf": Mode("--hf-model", "a Hugging Face transformers model", "docs/hf-models.md"),
    "init_from": Mode("--init-from", "start from a pretrained Hugging Face folder", "docs/hf-models.md"),
    "async_save": Mode("--async-save", "checkpoints written in the background", "docs/checkpoints.md"),
    "reshard_auto": Mode("--reshard-policy auto", "blocks kept gathered within --max-memory-per-rank",
                         "docs/design.md"),
}
"""The modes, in the order of the table's rows and columns."""


@dataclass(frozen=True)
class Orthogonal:
    """A switch that is no mode: it changes neither the model, nor the step, nor what a rank holds, so it meets every
    mode the same way; `test` shows the property that makes it so."""

    flag: str
    why: str
    test: str


ORTHOGONAL: dict[str, Orthogonal] = {
    "log": Orthogonal("--log tensorboard,wandb,trackio",
                      "each tracker is one more writer of the records metrics.jsonl gets (the same fan-out in every "
                      "mode; under fault tolerance each replica group writes its own run in its replica folder, as "
                      "its metrics.jsonl), and a resumed run continues the same step axis",
                      "tests/integration/test_train_trackers_job.py::"
                      "test_trackers_hold_the_jobs_losses_across_a_resume"),
    "datasets": Orthogonal("--data <datasets save_to_disk folder> [--split]",
                           "a corpus format: the documents become the same token stream as the same text in JSON "
                           "Lines, before any mode sees it",
                           "tests/integration/test_train_hf_datasets.py::"
                           "test_a_saved_dataset_trains_as_its_json_lines"),
}
"""Switches that are not modes (no pairs in the table), each with why and the test that shows it."""


@dataclass(frozen=True)
class Works:
    """The pair runs, and `test` (a pytest node id, ``tests/...py::test_name``) runs it and shows it right."""

    test: str
    how: str = ""
    """What the test compares, when its name does not say."""


@dataclass(frozen=True)
class Refused:
    """The job refuses the pair before any worker starts, with this reason (it ends with what to do instead)."""

    reason: str


_FT = "a fault-tolerant replica group is FSDP with outer degree 1 and AdamW, its replicas joined by torchft"
_DILOCO = "DiLoCo runs on HSDP's replicas with AdamW inside"
_HF = "a Hugging Face model is sharded by fully_shard alone"
_ASYNC_LIBRARY = "tests/distributed/test_checkpoint_async.py::test_async_save_equals_sync_save"
_ASYNC_JOB = "tests/integration/test_train_async_save.py"
_ASYNC_JOB_MODES = f"{_ASYNC_JOB}::test_async_save_equals_sync_save_under_diloco_from_a_pretrained_folder"
_AUTO_TEST = "tests/integration/test_train_reshard_auto.py::test_in_between_choice_equals_after_forward_bitwise"
_AUTO_HOW = ("the GPT-MoE at ep 2 under HSDP 2 x 2 with DiLoCo, 1 of 6 blocks kept within the budget (the cost "
             "model's need with one kept): every step and the final checkpoint bitwise the after_forward run's")
_AUTO_FT_TEST = "tests/integration/test_train_ft.py::test_groups_from_a_pretrained_folder_equal_hsdp"

PAIRS: dict[frozenset[str], Works | Refused] = {frozenset(pair): entry for pair, entry in [
    (("pp", "mp"), Refused("the job's pipeline stages are sharded by fully_shard alone, without the tensor-parallel "
                           "plan; use --pp or --mp, not both (docs/train-pipeline.md)")),
    (("pp", "cp"), Refused("the job's pipeline stages are sharded by fully_shard alone, without context-parallel "
                           "attention; use --pp or --cp, not both (docs/train-pipeline.md)")),
    (("pp", "ep"), Works("tests/integration/test_train_pp.py::test_pp2_learns_and_equals_pp1",
                         "the GPT-MoE at ep 2 inside each stage equals the --pp 1 run")),
    (("pp", "hsdp"), Works("tests/distributed/test_pipeline.py::test_pipeline_matches_single_process",
                           "case W4-pp2-O2: stages under HSDP outer 2 equal one process")),
    (("pp", "diloco"), Works("tests/integration/test_train_diloco.py::"
                               "test_pipeline_stages_match_the_unpipelined_run_and_resume_mid_period",
                               "--pp 2 DiLoCo equals the --pp 1 DiLoCo run step by step, and resumes mid-period")),
    (("pp", "ft"), Refused(f"{_FT}, with no pipeline stages (no --pp yet); see docs/fault-tolerance.md")),
    (("pp", "muon"), Refused("Muon's whole matrices per stage are not wired into the job's pipeline yet; use "
                             "--optimizer adamw (docs/train-pipeline.md)")),
    (("pp", "hf"), Refused("the pipeline stages are the GPT's (shardfusion.models.gpt_pipeline); drop --pp, or train "
                           "the GPT")),
    (("pp", "init_from"), Refused("the pipeline stages are the GPT's (shardfusion.models.gpt_pipeline); drop --pp, "
                                  "or train the GPT")),
    (("mp", "cp"), Works("tests/distributed/test_context_parallel.py::test_context_parallel_parity_world4",
                         "layout cp 2 x mp 2 equals one process")),
    (("mp", "ep"), Works("tests/distributed/test_tensor_parallel.py::test_tensor_parallel_parity_world8",
                         "layout mp 2 x sharding 4 x ep 2 equals one process")),
    (("mp", "hsdp"), Works("tests/integration/test_train_data_order.py::"
                           "test_tensor_and_context_parallel_runs_see_the_same_first_step",
                           "--mp 2 at 4 ranks is HSDP outer 2: its first step equals the default layout's")),
    (("mp", "diloco"), Works("tests/integration/test_train_diloco.py::test_tensor_parallel_replicas_equal_mp1",
                             "DiLoCo at --mp 2 (outer 2 x mp 2) equals DiLoCo at --mp 1: losses, norms, parameters")),
    (("mp", "ft"), Works("tests/integration/test_train_ft.py::test_tensor_parallel_groups_equal_hsdp_with_mp",
                         "2 replica groups x 2 ranks at --mp 2 equal one job with --mp 2 and outer degree 2")),
    (("mp", "muon"), Refused("Muon needs each matrix whole on one rank, but tensor parallel splits the blocks' "
                             "matrices over the mp ranks (DTensors, which fully_shard(whole_params=) does not take); "
                             "use --mp 1 or --optimizer adamw")),
    (("mp", "hf"), Refused("the tensor-parallel plan is the GPT's (shardfusion.models.gpt_parallel); drop --mp")),
    (("mp", "init_from"), Refused("the tensor-parallel plan is the GPT's (shardfusion.models.gpt_parallel); drop "
                                  "--mp")),
    (("cp", "ep"), Works("tests/unit/test_dry_run.py::test_context_and_expert_parallel_step",
                         "a dry run plays the step: cp all-gathers and ep all-to-alls on their groups")),
    (("cp", "hsdp"), Works("tests/integration/test_train_data_order.py::"
                           "test_tensor_and_context_parallel_runs_see_the_same_first_step",
                           "--cp 2 at 4 ranks is HSDP outer 2: its first step equals the default layout's")),
    (("cp", "diloco"), Refused(f"{_DILOCO}, without context-parallel attention (no --cp yet); see "
                               f"docs/slow-links.md")),
    (("cp", "ft"), Refused(f"{_FT}, without context-parallel attention (no --cp yet); see docs/fault-tolerance.md")),
    (("cp", "muon"), Works("tests/integration/test_train_muon.py::test_context_parallel_equals_cp1",
                           "Muon at --cp 2 (inner 2 x cp 2) equals Muon at --cp 1: every step's loss")),
    (("cp", "hf"), Refused("context-parallel attention is the GPT's (shardfusion.context_parallel); drop --cp")),
    (("cp", "init_from"), Refused("context-parallel attention is the GPT's (shardfusion.context_parallel); drop "
                                  "--cp")),
    (("ep", "hsdp"), Works("tests/integration/test_train.py::test_end_to_end_moe_hsdp_4_workers")),
    (("ep", "diloco"), Works("tests/integration/test_train_resume.py::"
                             "test_every_step_checkpoint_resumed_with_diloco_starts_a_new_period",
                             "the GPT-MoE at ep 2, HSDP outer 2, with DiLoCo outer steps")),
    (("ep", "ft"), Works("tests/integration/test_train_ft.py::test_all_alive_equals_hsdp_and_waits_for_min_replicas",
                         "2 replica groups x 2 ranks of the GPT-MoE at ep 2 equal one HSDP job at ep 2, bitwise")),
    (("ep", "muon"), Works("tests/integration/test_train_muon.py::test_muon_learns_from_the_adamw_start",
                           "the GPT-MoE at ep 2 with Muon")),
    (("ep", "hf"), Refused("a Hugging Face model's experts run in its own modules on every rank, so ep must be 1; "
                           "drop --ep")),
    (("ep", "init_from"), Refused("a Hugging Face model's experts run in its own modules on every rank, so ep must "
                                  "be 1; drop --ep")),
    (("hsdp", "diloco"), Works("tests/integration/test_train_diloco.py::test_resume_mid_period_is_exact",
                               "DiLoCo needs the replicas of HSDP (--fsdp-outer-degree >= 2)")),
    (("hsdp", "ft"), Refused(f"{_FT} (the other replica groups are the outer replicas; no --fsdp-outer-degree "
                             f"yet); see docs/fault-tolerance.md")),
    (("hsdp", "muon"), Works("tests/distributed/test_whole_params.py::test_muon_matches_single_process",
                             "layout hsdp-outer2-inner2 equals one process")),
    (("hsdp", "hf"), Works("tests/integration/test_train_hf.py::test_qwen3_moe_trains_under_hsdp")),
    (("hsdp", "init_from"), Works("tests/integration/test_train_finetune.py::"
                                  "test_finetune_matches_transformers_and_learns",
                                  "HSDP 2 x 2 from a pretrained folder equals transformers in one process")),
    (("diloco", "ft"), Works("tests/integration/test_train_ft.py::test_diloco_across_replica_groups_equals_diloco_on_hsdp",
                             "2 replica groups with DiLoCo equal one HSDP 2 x 2 DiLoCo job step by step; a group killed "
                             "between outer steps: test_diloco_a_group_killed_between_outer_steps")),
    (("diloco", "muon"), Refused(f"{_DILOCO} (no --optimizer muon yet); see docs/slow-links.md")),
    (("diloco", "hf"), Works("tests/integration/test_train_diloco.py::test_from_a_pretrained_folder",
                             "a Llama from a pretrained folder under DiLoCo: first loss from transformers, the "
                             "replicas equal after the outer step")),
    (("diloco", "init_from"), Works("tests/integration/test_train_diloco.py::test_from_a_pretrained_folder",
                                    "the first loss is transformers' on the folder's model, the outer snapshot "
                                    "the folder's weights")),
    (("ft", "muon"), Refused(f"{_FT}, which averages the gradients of AdamW's parameters (no --optimizer muon yet); "
                             f"see docs/fault-tolerance.md")),
    (("ft", "hf"), Works("tests/integration/test_train_ft.py::test_groups_from_a_pretrained_folder_equal_hsdp",
                         "2 replica groups x 2 ranks of a Llama equal one HSDP job, bitwise")),
    (("ft", "init_from"), Works("tests/integration/test_train_ft.py::test_groups_from_a_pretrained_folder_equal_hsdp",
                                "replica groups from a pretrained folder equal one HSDP job from it, bitwise; its "
                                "first loss is transformers'")),
    (("muon", "hf"), Works("tests/unit/test_train_muon_config.py::test_muon_takes_the_matrices_of_hf_decoder_layers",
                           "Muon takes the decoder layers' 2-D matrices, AdamW the rest")),
    (("muon", "init_from"), Works("tests/integration/test_train_hf.py::test_init_from_pretrained_folder",
                                  "the folder's weights load into Muon's owner layout: the first losses are "
                                  "transformers'")),
    (("hf", "init_from"), Works("tests/unit/test_hf_models.py::test_hf_model_and_init_from_together",
                                "--hf-model must name the folder's model type; the folder decides the model")),
    (("pp", "async_save"), Works(_ASYNC_LIBRARY, "case pp2: each rank's list of stages saved in the background "
                                                      "equals the synchronous save, key by key, bitwise")),
    (("mp", "async_save"), Works(_ASYNC_LIBRARY, "case mp2: the tensor-parallel GPT's fragments saved in the "
                                                      "background equal the synchronous save, bitwise")),
    (("cp", "async_save"), Works(_ASYNC_LIBRARY, "case cp2: cp 2 x sharding 2 saved in the background equals "
                                                      "the synchronous save, bitwise")),
    (("ep", "async_save"), Works(f"{_ASYNC_JOB}::test_killed_during_a_background_write_resumes_from_the_complete_"
                                 "checkpoint", "the GPT-MoE at ep 2, killed while a checkpoint is written in the "
                                 "background, resumes from the one before and ends bitwise equal to a run that "
                                 "saved only that one")),
    (("hsdp", "async_save"), Works(_ASYNC_JOB_MODES, "HSDP 2 x 1 with DiLoCo: the checkpoints written in the "
                                                     "background equal the synchronous run's, bitwise")),
    (("diloco", "async_save"), Works(_ASYNC_JOB_MODES, "DiLoCo's per-rank state (snapshot, outer momentum) saved in "
                                                       "the background equals the synchronous run's, bitwise")),
    (("ft", "async_save"), Refused(f"{_FT}; the quorum's first group writes each checkpoint and that group can "
                                   "change between saves, so a background write of a group that left the quorum "
                                   "could still run while another group publishes (which removes unfinished "
                                   "folders); drop --async-save (docs/checkpoints.md)")),
    (("muon", "async_save"), Works(_ASYNC_LIBRARY, "case muon: Muon's whole matrices and AdamW's state saved in "
                                                        "the background equal the synchronous save, bitwise")),
    (("hf", "async_save"), Works(_ASYNC_JOB_MODES, "a Llama: its checkpoints written in the background equal the "
                                                   "synchronous run's, bitwise")),
    (("init_from", "async_save"), Works(_ASYNC_JOB_MODES, "started from a pretrained folder: the checkpoints written "
                                                          "in the background equal the synchronous run's, bitwise")),
    (("pp", "reshard_auto"), Refused("a rank's pipeline stages are sharded one by one, each of them would be given "
                                     "the whole --max-memory-per-rank, and the schedule keeps the blocks gathered "
                                     "between micro-batches anyway; use --reshard-policy after_backward (the "
                                     "pipeline's default) or after_forward (docs/train-pipeline.md)")),
    (("mp", "reshard_auto"), Works("tests/distributed/test_tensor_parallel.py::test_tensor_parallel_parity_world4",
                                   "case mp2-inner2-auto: the tensor-parallel GPT under reshard_policy='auto' (a "
                                   "budget that keeps every block) equals one process")),
    (("cp", "reshard_auto"), Works("tests/integration/test_train_muon.py::test_context_parallel_equals_cp1",
                                   "the --cp 2 run under --reshard-policy auto (every block kept) equals --cp 1")),
    (("ep", "reshard_auto"), Works(_AUTO_TEST, _AUTO_HOW)),
    (("hsdp", "reshard_auto"), Works(_AUTO_TEST, _AUTO_HOW)),
    (("diloco", "reshard_auto"), Works(_AUTO_TEST, _AUTO_HOW)),
    (("ft", "reshard_auto"), Works(_AUTO_FT_TEST,
                                   "the replica groups under --reshard-policy auto (every layer kept) equal one HSDP "
                                   "job, bitwise")),
    (("muon", "reshard_auto"), Works("tests/integration/test_train_muon.py::test_context_parallel_equals_cp1",
                                     "Muon under --reshard-policy auto at --cp 2 equals Muon at --cp 1")),
    (("hf", "reshard_auto"), Works(_AUTO_FT_TEST,
                                   "a Llama's decoder layers under --reshard-policy auto in each replica group")),
    (("init_from", "reshard_auto"), Works(_AUTO_FT_TEST,
                                          "from a pretrained folder under --reshard-policy auto, bitwise the HSDP "
                                          "job's checkpoint")),
    (("async_save", "reshard_auto"), Works(_AUTO_TEST, "the auto run saves with --async-save: its checkpoint, "
                                                       "written in the background, equals the synchronous "
                                                       "after_forward run's, bitwise")),
]}
"""Every unordered pair of `MODES`, exactly once (tests/unit/test_compat.py)."""


def entry(a: str, b: str) -> Works | Refused:
    """The table's entry of modes ``a`` and ``b`` (either order).

    Raises:
        KeyError: a mode that is not in `MODES`, or ``a == b``.
    """
    for mode in (a, b):
        if mode not in MODES:
            raise KeyError(f"{mode!r} is not a mode of the compatibility table ({', '.join(MODES)})")
    return PAIRS[frozenset((a, b))]


def refusal(a: str, b: str) -> str:
    """The reason the job refuses modes ``a`` and ``b`` together.

    Raises:
        KeyError: the pair is not refused in the table (the check that calls this and the table disagree).
    """
    found = entry(a, b)
    if not isinstance(found, Refused):
        raise KeyError(f"the compatibility table does not refuse {a} with {b} ({found}); no refusal to give")
    return found.reason


def refuse(a: str, b: str, given_a: str, given_b: str) -> NoReturn:
    """Raise the job's one-line refusal of modes ``a`` and ``b``: ``"<given_a> with <given_b>: <reason>"``, where
    the givens are the flags as the user wrote them, e.g. ``--pp 2`` and ``--ft-lighthouse``.

    Raises:
        ValueError: always (KeyError when the table does not refuse the pair).
    """
    raise ValueError(f"{given_a} with {given_b}: {refusal(a, b)}")


def refuse_first(mode: str, given: str, candidates: list[tuple[str, str, object, bool]]) -> None:
    """`refuse` ``mode`` (switched on by the flag ``given``) with the first ``(other mode, flag, value, on)`` whose
    ``on`` is true, as ``"<flag> <value> with <given>: <reason>"``; nothing when none is.

    Raises:
        ValueError: the first candidate that is on.
    """
    for other, flag, value, on in candidates:
        if on:
            refuse(mode, other, f"{flag} {value}", given)


def pairs() -> list[tuple[str, str]]:
    """Every unordered pair of modes, in table order."""
    return list(itertools.combinations(MODES, 2))


_LETTER = {Works: "W", Refused: "R"}


def markdown() -> str:
    """docs/compatibility.md: the matrix of every pair, then each pair with its test or its reason."""
    names = list(MODES)
    lines = ["# Which modes combine", "",
             "Generated from `shardfusion/train/compat.py` by `python -m shardfusion.train.compat --markdown`; do not "
             "edit by hand (tests/unit/test_compat.py checks that this page matches the table). Each pair of the "
             "training job's modes either works, and names the test that runs it and shows it right, or is refused "
             "before any worker starts, with the reason the job prints.", "",
             "## Modes", "", "| mode | switched on by | what | docs |", "|---|---|---|---|"]
    lines += [f"| {name} | `{m.flag}` | {m.what} | {m.doc} |" for name, m in MODES.items()]
    lines += ["", "## Matrix", "", "W: works (tested), R: refused.", "",
              "| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in names:
        cells = ["-" if a == b else _LETTER[type(entry(a, b))] for b in names]
        lines.append(f"| **{a}** | " + " | ".join(cells) + " |")
    lines += ["", "## Not modes", "", "These switches change neither the model, nor the step, nor what a rank holds, "
              "so they meet every mode alike:", ""]
    lines += [f"- **{name}** (`{o.flag}`): {o.why}; `{o.test}`." for name, o in ORTHOGONAL.items()]
    lines += ["", "## Pairs", ""]
    for a, b in pairs():
        found = entry(a, b)
        if isinstance(found, Works):
            how = f": {found.how}" if found.how else ""
            lines.append(f"- **{a} + {b}**: works; `{found.test}`{how}.")
        else:
            lines.append(f"- **{a} + {b}**: refused; {found.reason}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m shardfusion.train.compat --markdown``: print docs/compatibility.md."""
    parser = argparse.ArgumentParser(prog="python -m shardfusion.train.compat", description=main.__doc__)
    parser.add_argument("--markdown", action="store_true", help="print the table as docs/compatibility.md")
    args = parser.parse_args(argv)
    if not args.markdown:
        parser.error("nothing to do: give --markdown")
    print(markdown(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
