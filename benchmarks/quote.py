"""Render the figures README.md and docs/*.md quote from the stored results, and check that they match.

    python -m benchmarks.quote            # rewrite every marked figure and table from benchmarks/results/
    python -m benchmarks.quote --check    # exit 1 and list every figure that differs or names no result

It reads only the stored results: it never reruns a benchmark. A figure in the docs is quoted between markers that
name the result it comes from (docs/benchmarks.md, "Quoted figures"):

- a figure in prose or in a table cell::

      <!-- q default-run.json summary.final_val_loss fmt=.2f -->2.03<!-- /q -->

  FILE is a path under ``benchmarks/results/``, KEY a dotted path into its JSON (:func:`lookup`: in a list a
  segment of digits, or ``-1``, is an index and ``field=value`` picks a record); options: ``fmt=`` a Python format
  spec (default: ``g`` for a number), ``div=KEY2`` divides by another value of the same file, ``scale=`` a factor
  applied next (``scale=1000`` for ms from seconds), ``round=N`` rounds to N decimals last (``round=-2``: to
  hundreds). ``<!-- q none REASON -->text<!-- /q -->`` marks a figure that
  is not a measurement (a design constant, a formula's value): it is left as written and exempt from the check;

- a table or a block of lines::

      <!-- quote cpu-fp32-speed.json compare-speed regime=comm -->
      ... (rendered) ...
      <!-- /quote -->

  TABLE names a renderer in :data:`TABLES` (its options are passed as keyword strings). ``rows`` is the generic
  one: ``path=KEY`` (a list of records, or a mapping whose keys are read as ``_key``) and ``columns="Header=key:fmt;
  ..."`` (``fmt`` optional; ``key`` is a dotted path inside the record).

Every marker's text is compared with its rendering: a figure edited by hand, or a result that changed without
``python -m benchmarks.quote``, makes ``--check`` fail (``tests/unit/test_quote.py``). The check also flags, in
README.md, a measured figure (a number with a unit of time, speed, memory, ratio or loss: :data:`MEASURED`) outside
every marker and outside code; and in docs/*.md, a section (a ``##`` heading and what follows up to the next) with
such a figure in a table row that names no result under ``benchmarks/results/`` (a link or a marker), unless the
section says why its figures are not results: ``<!-- figures: REASON -->``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
DOCS = ("README.md", "docs/*.md")
"""The files whose markers are rendered and checked (globs relative to the repository)."""

INLINE = re.compile(r"<!-- q (?P<spec>[^>]*?) -->(?P<text>.*?)<!-- /q -->", re.S)
BLOCK = re.compile(r"(?P<open><!-- quote (?P<spec>[^>]*?) -->\n)(?P<text>.*?)(?P<close><!-- /quote -->)", re.S)
MEASURED = re.compile(
    r"(?<![\w.])(?:\d[\d,]*\.\d+\s*x\b"  # a ratio: 0.63 x (not a layout such as 2 x 2)
    r"|\d[\d,]*(?:\.\d+)?\s*(?:ms|s|seconds?|minutes?|MiB|GiB|MB|GB|kB|tokens/s|nats|bits/byte)\b"
    r"|\d[\d,]*(?:\.\d+)?\s*%)")
"""A measured figure: a number followed by a unit of time, speed, memory, a ratio (``0.63 x``, but not a layout
such as ``2 x 2``), a percentage or a loss."""
CODE = re.compile(r"```.*?```|`(?:[^`\n]|\n(?!\s*\n))*`", re.S)
"""Code in a document: a marker there is an example, and a figure there is not checked."""
RESULT_LINK = re.compile(r"benchmarks/results/[\w.-]+")
"""A result named in prose (that the file exists is checked by tests/unit/test_repo_layout.py)."""
FIGURES = re.compile(r"<!-- figures: \S[^>]*-->")
"""A section's declaration that its table figures are not benchmark results, with the reason (test runtimes,
deterministic layout figures): ``<!-- figures: REASON -->``."""


class QuoteError(ValueError):
    """A marker that cannot be rendered: an unknown file, key, table or option (the message names the marker)."""


# ---- reading results ----------------------------------------------------------------------------------------------
def load(name: str, results: Path = RESULTS, cache: Optional[dict] = None) -> Any:
    """The JSON of ``results/name`` (``QuoteError`` when it is not there)."""
    cache = {} if cache is None else cache
    if name not in cache:
        path = results / name
        if not path.is_file():
            raise QuoteError(f"no result file benchmarks/results/{name}")
        cache[name] = json.loads(path.read_text())
    return cache[name]


def lookup(data: Any, key: str) -> Any:
    """The value at the dotted ``key`` of ``data`` (``.`` is ``data`` itself). In a list, a segment of digits (or
    ``-1``) is an index, and ``field=value`` the first record whose ``field`` reads ``value``. ``QuoteError`` names
    the first segment that is not there."""
    if key == ".":
        return data
    value = data
    for i, part in enumerate(key.split(".")):
        try:
            if isinstance(value, list) and "=" in part:
                field, _, want = part.partition("=")
                value = next(r for r in value if isinstance(r, dict) and str(r.get(field)) == want)
            else:
                value = value[int(part)] if isinstance(value, list) else value[part]
        except (KeyError, IndexError, ValueError, TypeError, StopIteration):
            raise QuoteError(f"key {key!r}: no {'.'.join(key.split('.')[:i + 1])!r}") from None
    return value


def fmt(value: Any, spec: Optional[str] = None, scale: Optional[str] = None, round_to: Optional[str] = None) -> str:
    """``value`` scaled, rounded and formatted with the format ``spec`` (None: a string as it is, a number
    with ``g``)."""
    if spec is None:
        spec = "" if isinstance(value, str) else "g"
    if scale is not None:
        value = value * float(scale)
    if round_to is not None:
        value = round(value, int(round_to))
    try:
        return format(value, spec)
    except (ValueError, TypeError) as e:
        raise QuoteError(f"cannot format {value!r} with {spec!r}: {e}") from None


def _words(spec: str, where: str) -> list[str]:
    try:
        return shlex.split(spec)
    except ValueError as e:
        raise QuoteError(f"{where}: {e}") from None


def _options(words: list[str], allowed: Iterable[str], where: str) -> dict[str, str]:
    opts = {}
    for w in words:
        k, eq, v = w.partition("=")
        if not eq or k not in allowed:
            raise QuoteError(f"{where}: unknown option {w!r} (allowed: {', '.join(sorted(allowed))})")
        opts[k] = v
    return opts


def render_inline(spec: str, results: Path = RESULTS, cache: Optional[dict] = None) -> Optional[str]:
    """The text of an inline marker ``<!-- q SPEC -->``; None for ``q none ...`` (kept as written)."""
    if spec.split()[:1] == ["none"]:  # the reason is prose: not split
        if len(spec.split()) < 2:
            raise QuoteError("<!-- q none --> needs a reason: <!-- q none REASON -->")
        return None
    words = _words(spec, f"<!-- q {spec} -->")
    if not words:
        raise QuoteError("an empty <!-- q --> marker")
    if len(words) < 2:
        raise QuoteError(f"<!-- q {spec} -->: FILE KEY expected")
    data = load(words[0], results, cache)
    opts = _options(words[2:], ("fmt", "scale", "div", "round"), f"<!-- q {spec} -->")
    try:
        value = lookup(data, words[1])
        if "div" in opts:
            value = value / lookup(data, opts["div"])
        return fmt(value, opts.get("fmt"), opts.get("scale"), opts.get("round"))
    except QuoteError as e:
        raise QuoteError(f"<!-- q {spec} -->: {e}") from None


# ---- tables ----------------------------------------------------------------------------------------------------
def table_rows(data: Any, path: str, columns: str) -> list[str]:
    """The generic table: one row per record at ``path``, columns ``"Header=key:fmt;..."``."""
    records = lookup(data, path)
    if isinstance(records, dict):
        records = [{"_key": k, **(v if isinstance(v, dict) else {"value": v})} for k, v in records.items()]
    cols = []
    for col in columns.split(";"):
        header, eq, rest = col.partition("=")
        if not eq:
            raise QuoteError(f"columns: {col!r} is not Header=key[:fmt]")
        key, _, spec = rest.partition(":")
        cols.append((header.strip(), key.strip(), spec or None))
    lines = ["| " + " | ".join(h for h, _, _ in cols) + " |", "|" + "---|" * len(cols)]
    for rec in records:
        lines.append("| " + " | ".join(fmt(lookup(rec, k), s) if k != "_key" else str(rec["_key"])
                                       for _, k, s in cols) + " |")
    return lines


def table_compare_speed(data: Any, regime: str = "comm", peers: str = "fsdp2,ddp,deepspeed,ds-hpz") -> list[str]:
    """A `benchmarks/compare.py` result: per variant the median step, tokens/s and shardfusion's paired ratio (the
    median over repeats of the ratio within one repeat) and ratio of medians against each peer."""
    summary = lookup(data, f"summary.{regime}")
    variants = summary["variants"]
    names = {"shardfusion": "shardfusion", "fsdp2": "FSDP2", "ddp": "DDP", "deepspeed": "DeepSpeed ZeRO-3",
             "ds-hpz": "DeepSpeed ZeRO++ hpZ"}
    sf = variants["shardfusion"]
    lines = ["| variant | step s (median) | tokens/s | shardfusion / variant: paired | per repeat | ratio of medians |",
             "|---|---|---|---|---|---|"]
    for name, v in variants.items():
        if "median_step_s" not in v:
            continue
        if name == "shardfusion":
            ratios = "1 | | 1"
        elif f"vs_{name}_paired" in sf:
            each = ", ".join(f"{r:.2f}" for r in sf.get(f"vs_{name}_per_repeat", []))
            ratios = f"{sf[f'vs_{name}_paired']:.2f} | {each} | {sf[f'vs_{name}']:.2f}"
        else:
            ratios = "n/a | | n/a"
        lines.append(f"| {names.get(name, name)} | {v['median_step_s']:.3f} | {v['tokens_per_s']:,.0f} | {ratios} |")
    return lines


def _x(value: Optional[float], spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def table_link_rate(data: Any, rate: str = "200mbit") -> list[str]:
    """A `benchmarks/link.py` result at one rate: per variant its step (DiLoCo: the mean over whole periods, with
    the median inner step and the mean outer step; others: the median), the larger node's link MB per step, and
    the ratios against sf-hsdp and DDP at this rate and against the one-node reference (paired in parentheses)."""
    s = lookup(data, f"summary.{rate}")
    rows, diloco = s["variants"], s.get("diloco") or {}
    lines = ["| variant | step s | inner step s (median) | outer step s (mean) | link MB/step per node | "
             "vs sf-hsdp (paired) | vs DDP (paired) | vs one node (paired) |", "|---|---|---|---|---|---|---|---|"]
    for v, row in rows.items():
        d = diloco.get(v)
        link = max(row["link_bytes_per_step"]) / 1e6
        if d is None:
            hsdp = rows.get("sf-hsdp")
            vs_hsdp = "1" if v == "sf-hsdp" else "n/a"
            if hsdp and v != "sf-hsdp":
                pairs = [a / b for a, b in zip(row["median_per_repeat_s"], hsdp["median_per_repeat_s"])]
                vs_hsdp = f"{row['median_step_s'] / hsdp['median_step_s']:.2f} ({statistics.median(pairs):.2f})"
            lines.append(f"| {row['label']} | {row['median_step_s']:.3f} (median) | | | {link:.2f} | {vs_hsdp} | "
                         f"{_x(row.get('vs_ddp'))} ({_x(row.get('vs_ddp_paired'))}) | |")
            continue
        lines.append(f"| {row['label']} | {d['mean_step_s']:.3f} (mean) | {_x(d['median_inner_step_s'], '.3f')} | "
                     f"{_x(d['mean_outer_step_s'], '.3f')} | {link:.2f} | {_x(d['vs_sf-hsdp'])} "
                     f"({_x(d['vs_sf-hsdp_paired'])}) | {_x(d['vs_ddp'])} ({_x(d['vs_ddp_paired'])}) | "
                     f"{_x(d['vs_one_node'])} ({_x(d.get('vs_one_node_paired'))}) |")
    return lines


def table_link_goal(data: Any, rate: str = "200mbit", goal: str = "1.15") -> list[str]:
    """The DiLoCo rows of a `benchmarks/link.py` result against the goal "the step within GOAL x of the run on one
    node": the paired ratio to the one-node reference (the ratio of means beside it), the mean step against the
    run's own median inner step, and whether the paired ratio meets the goal."""
    diloco = lookup(data, f"summary.{rate}.diloco")
    lines = ["| setting | vs one node, paired (ratio of means) | vs its own inner step | goal met (paired) |",
             "|---|---|---|---|"]
    for d in diloco.values():
        paired = d.get("vs_one_node_paired")
        own = d["mean_step_s"] / d["median_inner_step_s"] if d["median_inner_step_s"] else None
        met = "n/a" if paired is None else ("yes" if paired <= float(goal) else "no")
        setting = f"H = {d['every']}" + ("" if d["comm_dtype"] == "fp32" else f", {d['comm_dtype']}")
        lines.append(f"| {setting} | {_x(paired)} ({_x(d['vs_one_node'])}) | {_x(own)} | {met} |")
    return lines


def table_transient(data: Any, regime: str = "comm") -> list[str]:
    """A `benchmarks/compare.py` result: each variant's transient memory and the parts of its peak
    (`benchmarks/transient.py`)."""
    from benchmarks import transient

    return transient.table(lookup(data, f"summary.{regime}.variants"))


TABLES: dict[str, Callable[..., list[str]]] = {"rows": table_rows, "compare-speed": table_compare_speed,
                                               "link-rate": table_link_rate, "link-goal": table_link_goal,
                                               "transient": table_transient}
"""Renderers of ``<!-- quote FILE TABLE ... -->`` blocks: ``f(result json, **options) -> lines``."""


def render_block(spec: str, results: Path = RESULTS, cache: Optional[dict] = None) -> str:
    words = _words(spec, f"<!-- quote {spec} -->")
    if len(words) < 2:
        raise QuoteError(f"<!-- quote {spec} -->: FILE TABLE expected")
    name, table = words[0], words[1]
    if table not in TABLES:
        raise QuoteError(f"<!-- quote {spec} -->: unknown table {table!r} (known: {', '.join(sorted(TABLES))})")
    opts = dict(w.partition("=")[::2] for w in words[2:])
    try:
        return "\n".join(TABLES[table](load(name, results, cache), **opts)) + "\n"
    except (QuoteError, KeyError, TypeError) as e:
        raise QuoteError(f"<!-- quote {spec} -->: {e}") from None


# ---- documents ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    """One thing ``--check`` reports: the file, the line and what is wrong."""

    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def documents(repo: Path = REPO) -> list[Path]:
    return sorted({p for g in DOCS for p in repo.glob(g)})


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def render_text(text: str, results: Path = RESULTS, cache: Optional[dict] = None,
                where: str = "") -> tuple[str, list[Problem]]:
    """``text`` with every marker rendered, and the markers that could not be (as problems)."""
    cache = {} if cache is None else cache
    problems: list[Problem] = []
    code = [m.span() for m in CODE.finditer(text)]  # a marker shown in code is an example, not a quote

    def in_code(m: re.Match) -> bool:
        return any(a <= m.start() < b for a, b in code)

    def block(m: re.Match) -> str:
        if in_code(m):
            return m[0]
        try:
            return m["open"] + render_block(m["spec"], results, cache) + m["close"]
        except QuoteError as e:
            problems.append(Problem(where, _line(text, m.start()), str(e)))
            return m[0]

    def inline(m: re.Match) -> str:
        if in_code(m):
            return m[0]
        try:
            value = render_inline(m["spec"], results, cache)
        except QuoteError as e:
            problems.append(Problem(where, _line(text, m.start()), str(e)))
            return m[0]
        return m[0] if value is None else f"<!-- q {m['spec']} -->{value}<!-- /q -->"

    text = BLOCK.sub(block, text)
    code = [m.span() for m in CODE.finditer(text)]  # again: the blocks' new text moved the spans
    return INLINE.sub(inline, text), problems


def _strip(text: str) -> str:
    """``text`` with markers, code blocks, inline code and link targets blanked (newlines kept), for the search of
    unmarked figures."""
    def blank(m: re.Match) -> str:
        return re.sub(r"[^\n]", " ", m[0])
    for pattern in (r"(?m)^ {4}[^\n]*$", CODE.pattern, BLOCK.pattern, INLINE.pattern, r"\]\([^)\n]*\)",
                    r"<!--.*?-->"):
        text = re.sub(pattern, blank, text, flags=re.S)
    return text


def unmarked_figures(text: str) -> list[tuple[int, str]]:
    """(line, figure) of every measured figure (:data:`MEASURED`) outside markers and code."""
    plain = _strip(text)
    return [(_line(plain, m.start()), m[0]) for m in MEASURED.finditer(plain)]


def unnamed_sections(text: str) -> list[tuple[int, str]]:
    """(line, heading) of every ``##`` section with a measured figure in a table row that names no result under
    benchmarks/results/ (a link, a path or a marker)."""
    out = []
    starts = [m.start() for m in re.finditer(r"^#{2,} ", text, re.M)]
    for a, b in zip([0] + starts, starts + [len(text)]):
        section = text[a:b]
        plain = _strip(section)
        rows = [ln for ln in plain.splitlines() if ln.lstrip().startswith("|")]
        if not any(MEASURED.search(r) for r in rows):
            continue
        if any(p.search(section) for p in (RESULT_LINK, INLINE, BLOCK, FIGURES)):
            continue
        out.append((_line(text, a), section.splitlines()[0] if section else ""))
    return out


def check(repo: Path = REPO, results: Optional[Path] = None) -> list[Problem]:
    """Every problem in the documents of ``repo``: markers that do not render or differ from the stored results,
    README figures outside markers, docs sections with figures in tables that name no result."""
    results = repo / "benchmarks" / "results" if results is None else results
    cache: dict = {}
    problems = []
    for path in documents(repo):
        rel = str(path.relative_to(repo))
        text = path.read_text()
        rendered, bad = render_text(text, results, cache, rel)
        problems += bad
        if rendered != text:
            old_lines, new_lines = text.splitlines(), rendered.splitlines()
            for op, i1, _, j1, j2 in difflib.SequenceMatcher(None, old_lines, new_lines, False).get_opcodes():
                if op != "equal":
                    shown = " / ".join(line.strip() for line in new_lines[j1:j2])[:200]
                    problems.append(Problem(rel, i1 + 1, f"differs from its result; rendered: {shown}"))
        if rel == "README.md":
            problems += [Problem(rel, n, f"figure {fig!r} names no result (mark it: <!-- q FILE KEY -->)")
                         for n, fig in unmarked_figures(text)]
        else:
            problems += [Problem(rel, n, f"section {head!r} has measured figures in a table but names no result "
                                         f"under benchmarks/results/") for n, head in unnamed_sections(text)]
    return problems


def render(repo: Path = REPO) -> list[Path]:
    """Rewrite every document's markers from the stored results; returns the files changed. A document with a
    marker that cannot be rendered is left as it is, and QuoteError lists those markers after the others are
    written."""
    cache: dict = {}
    changed, problems = [], []
    for path in documents(repo):
        text = path.read_text()
        rendered, bad = render_text(text, repo / "benchmarks" / "results", cache, str(path.relative_to(repo)))
        problems += bad
        if rendered != text and not bad:
            path.write_text(rendered)
            changed.append(path)
    if problems:
        raise QuoteError("\n".join(map(str, problems)))
    return changed


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 listing every problem")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for p in problems:
            print(p)
        print(f"{len(problems)} problem(s)" if problems else "every quoted figure matches its result")
        return 1 if problems else 0
    try:
        changed = render()
    except QuoteError as e:
        print(f"benchmarks.quote: error: {e}", file=sys.stderr)
        return 1
    for path in changed:
        print(f"rendered {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
