"""Quoted figures stay true: every figure README.md and docs/*.md quote matches the stored result it names
(benchmarks/quote.py, docs/benchmarks.md "Quoted figures"), and the check catches a figure edited by hand, a result
changed without rendering, and a figure that names no result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import quote

README = """# x

The loss falls to <!-- q run.json summary.loss fmt=.2f -->2.03<!-- /q --> nats/byte
(<!-- q run.json summary.tokens_per_s fmt=,.0f -->12,412<!-- /q --> tokens/s; a step of
<!-- q run.json summary.step_s scale=1000 fmt=.0f -->57<!-- /q --> ms, <!-- q run.json summary.step_s div=summary.ref_s
fmt=.2f -->1.25<!-- /q --> x the reference), layout 2 x 2, int8 is <!-- q none block-wise format -->0.25 x<!-- /q -->.

<!-- quote run.json rows path=summary.rows columns="seed=seed;loss=loss:.3f" -->
| seed | loss |
|---|---|
| 42 | 2.030 |
| 43 | 1.950 |
<!-- /quote -->

Seed 43 by its field: <!-- q run.json "summary.rows.seed=43.loss" fmt=.2f -->1.95<!-- /q -->.

A marker shown as an example in code is not rendered: `<!-- q missing.json key -->3 s<!-- /q -->`.
"""
RESULT = {"summary": {"loss": 2.0312, "tokens_per_s": 12412.3, "step_s": 0.0571, "ref_s": 0.04568,
                      "rows": [{"seed": 42, "loss": 2.03}, {"seed": 43, "loss": 1.95}]}}


def _repo(tmp_path: Path, readme: str = README, result: dict = RESULT, docs: str = "") -> Path:
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "run.json").write_text(json.dumps(result))
    (tmp_path / "README.md").write_text(readme)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(docs or "# page\n")
    return tmp_path


def test_every_quoted_figure_in_the_docs_matches_its_result() -> None:
    problems = quote.check()
    assert not problems, "\n".join(map(str, problems)) + "\n(run: python -m benchmarks.quote)"


def test_rendered_markers_pass_the_check(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    assert quote.check(repo) == []
    assert quote.render(repo) == []  # nothing to change


def test_a_figure_edited_by_hand_is_flagged_and_rendering_restores_it(tmp_path: Path) -> None:
    repo = _repo(tmp_path, README.replace("-->2.03<", "-->1.99<").replace("| 43 | 1.950 |", "| 43 | 1.900 |"))
    problems = quote.check(repo)
    assert [p.line for p in problems] == [3, 12], problems
    assert "rendered: The loss falls to <!-- q run.json summary.loss fmt=.2f -->2.03<!-- /q -->" in str(problems[0])
    assert quote.render(repo) == [repo / "README.md"]
    assert (repo / "README.md").read_text() == README
    assert quote.check(repo) == []


def test_a_result_changed_without_rendering_is_flagged(tmp_path: Path) -> None:
    result = json.loads(json.dumps(RESULT))
    result["summary"]["tokens_per_s"] = 16712.0
    repo = _repo(tmp_path, result=result)
    problems = quote.check(repo)
    assert len(problems) == 1 and problems[0].line == 4 and "16,712" in problems[0].message


def test_a_figure_that_names_no_result_is_flagged(tmp_path: Path) -> None:
    readme = README + "\nSpeed: 0.63 x FSDP2's step, 1.2 s per step, 16,000 tokens/s, 5 % faster; `12 s` in code.\n"
    docs = ("# page\n\n## Measured\n\n| variant | step s |\n|---|---|\n| a | 0.241 s |\n\n"
            "## Named\n\nFrom [r](../benchmarks/results/run.md):\n\n| a | 0.5 s |\n\n## Flags\n\n| `--n` | 3 |\n")
    problems = quote.check(_repo(tmp_path, readme, docs=docs))
    assert [(p.path, p.line) for p in problems] == [("README.md", 19)] * 4 + [("docs/page.md", 3)], problems
    for p, figure in zip(problems, ("0.63 x", "1.2 s", "16,000 tokens/s", "5 %")):
        assert p.message.startswith(f"figure {figure!r} names no result"), p
    assert "'## Measured'" in problems[4].message


@pytest.mark.parametrize("marker, message", [
    ("<!-- q missing.json a -->1<!-- /q -->", "no result file benchmarks/results/missing.json"),
    ("<!-- q run.json summary.nope -->1<!-- /q -->", "key 'summary.nope': no 'summary.nope'"),
    ("<!-- q run.json summary.rows.5.loss -->1<!-- /q -->", "no 'summary.rows.5'"),
    ("<!-- q run.json summary.rows.seed=44.loss -->1<!-- /q -->", "no 'summary.rows.seed=44'"),
    ("<!-- q run.json summary.loss fmt=.2f size=3 -->1<!-- /q -->", "unknown option 'size=3'"),
    ("<!-- q none -->1<!-- /q -->", "needs a reason"),
    ("<!-- quote run.json nope -->\nx\n<!-- /quote -->", "unknown table 'nope'"),
])
def test_a_marker_that_cannot_be_rendered_names_itself(tmp_path: Path, marker: str, message: str) -> None:
    repo = _repo(tmp_path, f"# x\n\n{marker}\n")
    problems = quote.check(repo)
    assert len(problems) == 1 and problems[0].line == 3 and message in problems[0].message, problems
    with pytest.raises(quote.QuoteError, match=message.split("'")[0]):
        quote.render(repo)
    assert (repo / "README.md").read_text() == f"# x\n\n{marker}\n"  # nothing written
