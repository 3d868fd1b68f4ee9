"""The compatibility table of the training job's modes (shardfusion/train/compat.py) against the job and the suite:
every pair of modes once; every "works" pair names a test function that exists (read with ast, nothing imported);
every refused pair is refused by the job's own flag checks (parse, validate, resolve, check_run at 8 ranks, in this
process) with the table's reason; every pair the table does not refuse passes those checks; docs/compatibility.md is
the table's rendering."""

from __future__ import annotations

import ast
import functools
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness import REPO
from shardfusion.train import compat, ft_config
from shardfusion.train.compat import MODES, PAIRS, Refused, Works
from shardfusion.train.config import JobConfig, build_parser, check_run, resolve

WORLD = 8
"""The world size of the checks: even for every degree of 2 a pair asks for, and 4 ranks to an HSDP replica."""


def _flags(mode: str, folder: Path) -> list[str]:
    """The flags that switch ``mode`` on, with the others' defaults (a dense tiny GPT of the base flags)."""
    return {
        "pp": ["--pp", "2"], "mp": ["--mp", "2"], "cp": ["--cp", "2"], "ep": ["--experts", "4", "--ep", "2"],
        "hsdp": ["--fsdp-outer-degree", "2"], "diloco": ["--outer-sync", "diloco"],
        "ft": ["--ft-lighthouse", "http://127.0.0.1:9", "--ft-replicas", "2", "--ft-replica-id", "0"],
        "muon": ["--optimizer", "muon"], "hf": ["--hf-model", "llama"], "init_from": ["--init-from", str(folder)],
        "async_save": ["--async-save"],
        "reshard_auto": ["--reshard-policy", "auto", "--max-memory-per-rank", "1GB"],
    }[mode]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What `config.check_pretrained` reads of a pretrained folder: a Llama's config.json and a weights file."""
    folder = tmp_path_factory.mktemp("pretrained")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 256,
                                                    "max_position_embeddings": 256}))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def _check(argv: list[str]) -> None:
    """The job's checks before any worker starts (`shardfusion.train.job.preflight` without the device, the
    lighthouse and the corpus's tokens): parse, validate, the fault-tolerance and run-time defaults, check_run."""
    config = JobConfig.from_flat(**vars(build_parser().parse_args(argv)))
    config.validate()
    job = resolve(config, device="cpu", world_size=WORLD, ft_host=ft_config.resolve_host(config.ft),
                  world=f"--nproc {WORLD}")
    check_run(job, world=f"--nproc {WORLD}")


def _argv(a: str, b: str, folder: Path, out: Path) -> list[str]:
    return ["--preset", "tiny", "--experts", "0", "--data-bytes", "300000", "--out", str(out),
            *_flags(a, folder), *_flags(b, folder)]


def test_every_pair_once() -> None:
    assert len(MODES) == 12
    assert set(PAIRS) == {frozenset(p) for p in itertools.combinations(MODES, 2)}
    assert len(PAIRS) == len(compat.pairs()) == 66
    assert all(isinstance(e, (Works, Refused)) for e in PAIRS.values())  # no third kind
    with pytest.raises(KeyError, match="'sep' is not a mode"):
        compat.entry("sep", "pp")
    with pytest.raises(KeyError, match="does not refuse ep with hsdp"):
        compat.refusal("ep", "hsdp")


@functools.lru_cache(maxsize=None)
def _test_functions(path: str) -> frozenset[str]:
    """The names of the test functions defined at the top level of a test file."""
    tree = ast.parse((REPO / path).read_text())
    return frozenset(node.name for node in tree.body
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"))


@pytest.mark.parametrize("pair", [p for p in compat.pairs() if isinstance(compat.entry(*p), Works)], ids="+".join)
def test_works_names_a_test_that_exists(pair: tuple[str, str]) -> None:
    _assert_test_exists(compat.entry(*pair).test)


@pytest.mark.parametrize("name", list(compat.ORTHOGONAL))
def test_each_switch_that_is_no_mode_names_a_test_that_exists(name: str) -> None:
    assert name not in compat.MODES
    _assert_test_exists(compat.ORTHOGONAL[name].test)


def _assert_test_exists(test: str) -> None:
    path, _, name = test.partition("::")
    assert path.startswith("tests/") and path.endswith(".py") and name, test
    assert (REPO / path).is_file(), test
    assert name in _test_functions(path), f"{test}: no such test function"


@pytest.mark.parametrize("pair", [p for p in compat.pairs() if isinstance(compat.entry(*p), Refused)], ids="+".join)
def test_refused_by_the_job_with_the_table_reason(pair: tuple[str, str], pretrained: Path, tmp_path: Path) -> None:
    a, b = pair
    with pytest.raises(ValueError) as error:
        _check(_argv(a, b, pretrained, tmp_path / "run"))
    message = str(error.value)
    assert message.endswith(": " + compat.refusal(a, b)), message
    assert "\n" not in message


@pytest.mark.parametrize("pair", [p for p in compat.pairs() if not isinstance(compat.entry(*p), Refused)],
                         ids="+".join)
def test_not_refused_pairs_pass_the_checks(pair: tuple[str, str], pretrained: Path, tmp_path: Path) -> None:
    _check(_argv(*pair, pretrained, tmp_path / "run"))


def test_refusal_message_names_both_flags() -> None:
    with pytest.raises(ValueError) as error:
        JobConfig.from_flat(pp=2, ft_lighthouse="http://127.0.0.1:9", ft_replicas=2, ft_replica_id=0,
                            out="x").validate()
    assert str(error.value) == f"--pp 2 with --ft-lighthouse: {compat.refusal('ft', 'pp')}"
    assert "docs/fault-tolerance.md" in str(error.value)


def test_docs_page_is_the_table() -> None:
    page = (REPO / "docs" / "compatibility.md").read_text()
    assert page == compat.markdown(), "run: python -m shardfusion.train.compat --markdown > docs/compatibility.md"
    result = subprocess.run([sys.executable, "-m", "shardfusion.train.compat", "--markdown"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == page, result.stderr
