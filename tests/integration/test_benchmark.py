"""benchmarks/compare.py runs end to end (4 gloo workers, the tiny regime, one step per variant) and writes a JSON and
a markdown report with the three variants. No timing is asserted: only that the run works and that what it
measures is self-consistent (the collective counts of the HSDP layout, the same first loss in every variant).

benchmarks/memory.py runs end to end (2 gloo workers per variant, a tiny GPT, one step) and writes a well-formed
JSON and markdown report with positive figures. No memory size is asserted: the sizes are what the benchmark
reports.

benchmarks/whole_params.py runs end to end (2 gloo workers in one launch, a 1-block GPT, one step per variant) and
writes its table with the three variants. No timing is asserted; what is exact is: the all-gather bytes the layouts
predict are the measured ones, the Muon state of (a) is the largest owner's share of (b)'s, the same first loss in
every variant, and Muon on owner ranks and Muon on every rank reach the same parameters.

benchmarks/pipeline.py runs end to end (4 gloo workers, pp 2 x sharding 2, a 4-layer GPT of width 32, 2
micro-batches, one step per variant: 1F1B and interleaved 1F1B under after_forward, 1F1B under after_backward) and
writes its JSON and markdown report with both variants in every case. No timing is asserted; what is exact is: one
reduce-scatter per unit per step for shardfusion and for FSDP2 under torch's PipelineStage (not one per
micro-batch), the P2P sends the activation shapes predict, shardfusion's all-gathers as the after_forward policy
predicts (cross-checked with its own counter), the same counts on every rank of a stage, and the same first loss in
both variants.

benchmarks/async_save.py runs end to end (2 gloo workers, 2 pairs of saves of the tiny GPT): the saves alternate,
each asynchronous save has its parts, and one pair of saves of the same state is equal bitwise.

benchmarks/reshard_curve.py runs end to end (2 gloo workers, FSDP over both, the tiny regime with 5 blocks, one
step per variant) and writes its JSON, markdown and plot: one shardfusion point per distinct need of the cost model
(0, 1 and all 5 blocks kept), each within its budget, with the all-gathers its choice predicts and more gathered
parameters alive with all kept; FSDP2 with reshard_after_forward True and False, and DDP; the same first loss in
every variant. No timing is asserted.

benchmarks/paired_commits.py runs end to end (the working tree against itself as a folder, the tiny regime, one
round of one step per tree, 4 fresh gloo workers per run) and writes its JSON and markdown: both trees ran the same
step (the same loss, exactly: the same code, seed and data). No timing is asserted.

benchmarks/gloo_spin.py runs end to end (4 gloo workers in 2 pairs, one round of two exchanges per variant; each
worker checks the gathered values) and writes its JSON and markdown with both variants. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness import REPO, clean_env, run_command


@pytest.mark.timeout(120)
def test_compare_smoke(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, str(REPO / "benchmarks" / "compare.py"), "--regimes", "tiny", "--repeats", "1",
           "--warmup", "1", "--steps", "1", "--device", "cpu", "--out-dir", str(tmp_path), "--name", "smoke"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, f"compare.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads((tmp_path / "smoke.json").read_text())
    md = (tmp_path / "smoke.md").read_text()
    rows = data["summary"]["tiny"]["variants"]
    assert set(rows) == {"shardfusion", "fsdp2", "ddp"}
    for name in ("shardfusion", "fsdp2", "ddp"):
        assert f"| {name} |" in md
        assert rows[name]["median_step_s"] > 0
    n_blocks = 2
    for name in ("shardfusion", "fsdp2"):  # HSDP 2 x 2: counts per step, and one outer all-reduce per unit
        c = rows[name]["collectives"]
        assert c["all_gather/inner"]["count"] == 2 * n_blocks + 1, c
        assert c["reduce_scatter/inner"]["count"] == n_blocks + 1, c
        assert c["all_reduce/outer"]["count"] == n_blocks + 1, c
    assert data["regimes"]["tiny"]["variants"]["shardfusion"]["cross_check"]["agree"]
    first = {name: rows[name]["loss_first_last"][0] for name in rows}
    assert max(first.values()) - min(first.values()) < 1e-4, first  # same model, same data
    assert "Transient memory at the peak" in md
    for name in rows:  # the breakdown of the peak adds up to it; the transient is what is not kept across steps
        t = rows[name]["transient_memory"]
        assert sum(t["parts"].values()) == t["peak"] and t["transient"] == t["peak"] - t["persistent"] > 0, (name, t)
        assert t["parts"]["activations"] > 0, (name, t)
    sf = rows["shardfusion"]["transient_memory"]
    assert set(sf["units"]["full_params"]) >= {""}, sf  # the root unit stays gathered from forward to backward
    assert 0 < sf["grads_vs_bound"] <= 1.01, sf  # gradient reductions in flight bounded: within the bound


@pytest.mark.timeout(240)
def test_memory_smoke(tmp_path):
    env = {**clean_env(), "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, str(REPO / "benchmarks" / "memory.py"), "--model-size", "tiny", "--world-size", "2",
           "--steps", "1", "--device", "cpu", "--out-dir", str(tmp_path), "--name", "smoke"]
    proc = run_command(cmd, timeout=220, env=env)
    assert proc.returncode == 0, f"memory.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads((tmp_path / "smoke.json").read_text())
    md = (tmp_path / "smoke.md").read_text()
    variants = ("shardfusion-eager", "shardfusion-meta", "fsdp2-eager", "fsdp2-meta")
    assert data["benchmark"] == "memory" and set(data["runs"]) == set(variants)
    summary = data["summary"]
    assert summary["params"] > 0 and summary["model_bytes"] == 4 * summary["params"]
    for name in variants:
        row = summary["variants"][name]
        assert f"| {name} | build |" in md
        assert row["baseline"]["hwm_bytes"] > 0 and row["baseline"]["rss_bytes"] > 0
        for rank in data["runs"][name][0]["ranks"]:
            assert rank["phases"]["baseline"]["hwm_bytes"] >= rank["phases"]["baseline"]["rss_bytes"] > 0
        assert row["error"] is None, row["error"]
        assert list(row["phases"]) == ["build", "wrap", "load", "steps"], row["phases"]
        for phase, ph in row["phases"].items():
            assert f"| {name} | {phase} |" in md
            assert ph["hwm_growth_bytes"] >= 0 and ph["seconds"] >= 0
            assert ph["theory_hwm_bytes"] >= ph["theory_peak_bytes"] >= 0
            if phase != "build" or name.endswith("-eager"):
                assert ph["live_bytes"] > 0 and ph["theory_live_bytes"] > 0
        assert row["phases"]["steps"]["theory_hwm_bytes"] > 0
        assert len(row["losses"]) == 1 and 0 < row["losses"][0] < 10  # ln(256) = 5.5 at the start


@pytest.mark.timeout(150)
def test_whole_params_smoke(tmp_path):
    out = tmp_path / "whole-params.md"
    cmd = [sys.executable, "-m", "benchmarks.whole_params", "--nproc", "2", "--models", "dense", "--n-layer", "1",
           "--d-model", "32", "--n-head", "2", "--seq", "16", "--batch", "1", "--warmup", "1", "--steps", "1",
           "--launch", "once", "--out", str(out)]
    proc = run_command(cmd, timeout=140, env={**clean_env(), "GLOO_SOCKET_IFNAME": "lo"})
    assert proc.returncode == 0, (f"whole_params failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-3000:]}")
    md = out.read_text()
    data = json.loads(out.with_suffix(".json").read_text())
    for label in ("(a) Muon, whole_params", "(b) Muon, replicate_filter", "(c) AdamW, element-sharded"):
        assert sum(line.startswith(f"| {label}") for line in md.splitlines()) == 2 + 1, label  # 2 ranks + bytes
    summary = data["summary"]["dense"]
    assert all(summary["gather_prediction_matches"].values()), summary["gather_prediction_matches"]
    ratios = summary["ratios"]
    assert ratios["muon_state_a_over_b"]["measured"] == pytest.approx(ratios["muon_state_a_over_b"]["theory"])
    assert ratios["muon_state_a_over_b"]["measured"] < 0.75  # 6 matrices over 2 owners
    assert ratios["memory_a_over_b"]["measured"] == pytest.approx(ratios["memory_a_over_b"]["theory"], rel=0.05)
    assert summary["balance"]["dense"]["cost"] == [196608, 196608]  # each: one 128 x 32, two 32 x 32
    rows = {v: data["results"][f"dense/{v}"] for v in ("whole", "replicated", "adamw")}
    for rank in range(2):
        first = {v: rows[v][rank]["losses"][0] for v in rows}
        assert max(first.values()) - min(first.values()) < 1e-6, first  # same model, same data
        assert rows["whole"][rank]["losses"][-1] == pytest.approx(rows["replicated"][rank]["losses"][-1], abs=1e-3)
        assert all(t > 0 for t in rows["whole"][rank]["median_s"].values())
    # one Muon step of lr 0.02 moves a matrix entry by ~0.02: a matrix updated wrongly or not at all shows
    assert summary["params_max_diff_a_b"]["matrices"] < 2e-3, summary["params_max_diff_a_b"]
    assert summary["params_max_diff_a_b"]["rest"] < 1e-5, summary["params_max_diff_a_b"]


@pytest.mark.timeout(120)
def test_pipeline_smoke(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.pipeline", "--schedules", "1f1b,interleaved", "--microbatches", "2",
           "--study-microbatches", "2", "--repeats", "1", "--warmup", "0", "--steps", "1", "--n-layer", "4",
           "--d-model", "32", "--n-head", "2", "--seq", "16", "--out-dir", str(tmp_path), "--name", "smoke"]
    proc = run_command(cmd, timeout=110, env={**clean_env(), "GLOO_SOCKET_IFNAME": "lo"})
    assert proc.returncode == 0, f"pipeline failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads((tmp_path / "smoke.json").read_text())
    md = (tmp_path / "smoke.md").read_text()
    assert data["benchmark"] == "pipeline"
    cases = data["summary"]["cases"]
    assert set(cases) == {"1f1b-M2-after_forward", "interleaved-M2-after_forward", "1f1b-M2-after_backward"}
    for name, case in cases.items():
        rows = case["variants"]
        assert set(rows) == {"shardfusion", "fsdp2"}, rows
        for v, row in rows.items():
            assert "error" not in row, (name, v, row)
            assert f"| {name} | {v} |" in md
            assert row["median_step_s"] > 0 and 0 <= row["bubble_measured"] <= 1
            assert set(row["stages"]) == {"0", "1"}
            for k, stage in row["stages"].items():
                c = stage["collectives"]
                # one reduce-scatter per unit per step for both libraries (not one per micro-batch)
                assert c["reduce_scatter/inner"]["count"] == c["reduce_scatter/inner"]["theory_count"], (name, v, k)
                assert c["p2p_send/pp"]["count"] == c["p2p_send/pp"]["theory_count"] > 0, (name, v, k)
                assert stage["same_on_every_rank_of_the_stage"], (name, v, k)
                assert stage["step_peak_growth_bytes"] > 0 and stage["persistent_ratio"] > 0.99
                if v == "shardfusion" and case["reshard"] == "after_forward":  # every gather as designed
                    assert c["all_gather/inner"]["count"] == c["all_gather/inner"]["theory_count"], (name, k, c)
                    assert stage["cross_check"]["agree"], stage["cross_check"]
        first = [row["losses"][0] for row in rows.values()]
        assert max(first) - min(first) < 1e-4, (name, first)  # same model, same data


@pytest.mark.timeout(150)
def test_async_save_smoke(tmp_path):
    """benchmarks/async_save.py runs end to end (2 gloo workers, HSDP 2 x 1, the tiny GPT, 2 pairs of saves a step
    apart) and writes its JSON and markdown report. No timing is asserted; what is exact is: the saves alternate
    (the order swapped in the second pair), each asynchronous save has its parts (a staging copy on the calling
    thread and one behind the loop) and a background write, the stall is the call plus the waits, and one pair of
    saves of the same state is equal bitwise."""
    cmd = [sys.executable, "-m", "benchmarks.async_save", "--preset", "tiny", "--nproc", "2", "--outer", "2",
           "--pairs", "2", "--every", "1", "--out-dir", str(tmp_path), "--name", "smoke"]
    proc = run_command(cmd, timeout=140)
    assert proc.returncode == 0, f"async_save.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    summary = json.loads((tmp_path / "smoke.json").read_text())["summary"]
    assert [(s["pair"], s["kind"]) for s in summary["saves"]] == [(0, "sync"), (0, "async"), (1, "async"), (1, "sync")]
    for save in (s for s in summary["saves"] if s["kind"] == "async"):
        assert save["stall_s"] >= save["call_s"] >= save["staging_s"] > 0 and save["write_s"] > 0, save
        assert save["behind_s"] > 0 and save["stall_s"] >= save["call_s"] + save["staged_wait_s"], save
    assert summary["async_equals_sync"] is True
    assert len(summary["pair_ratios"]) == 2 and summary["ratio"] > 0
    assert "Stall over synchronous save" in (tmp_path / "smoke.md").read_text()


@pytest.mark.timeout(150)
def test_reshard_curve_smoke(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.reshard_curve", "--regime", "tiny", "--n-layer", "5", "--nproc", "2",
           "--outer", "1", "--repeats", "1", "--warmup", "0", "--steps", "1", "--out-dir", str(tmp_path),
           "--name", "smoke"]
    proc = run_command(cmd, timeout=140, env={**clean_env(), "GLOO_SOCKET_IFNAME": "lo"})
    assert proc.returncode == 0, (f"reshard_curve failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-3000:]}")
    data = json.loads((tmp_path / "smoke.json").read_text())
    rows = {r["variant"]: r for r in data["points"] + data["peers"]}
    assert set(rows) == {"auto-0", "auto-1", "auto-2", "fsdp2-raf-true", "fsdp2-raf-false", "ddp"}
    points = [rows[f"auto-{i}"] for i in range(3)]
    assert [p["kept"] for p in points] == [0, 1, 5]  # prefetch 1: 3 resharded blocks count, so 2 kept cost all 5's
    assert [p["all_gathers"] for p in points] == [1 + 2 * 5, 1 + 2 * 5 - 1, 1 + 5]
    assert all(p["estimate_mb"] <= p["budget_mb"] for p in points)
    assert all(low <= p["peak_live_mb"] <= high for p in points for low, high in [p["peak_live_range_mb"]])
    # all 5 blocks gathered at once, against at most prefetch + 2 = 3
    assert points[0]["full_params_mb"] < points[-1]["full_params_mb"]
    first = [r["loss_first"] for r in rows.values()]
    assert max(first) - min(first) < 1e-4, first  # same model, same data
    assert (tmp_path / "smoke.png").stat().st_size > 0
    assert "| shardfusion auto, 1/5 kept | " in (tmp_path / "smoke.md").read_text()


@pytest.mark.timeout(150)
def test_paired_commits_smoke(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "benchmarks.paired_commits", "--against", str(REPO), "--candidate", str(REPO),
           "--regime", "tiny", "--rounds", "1", "--warmup", "0", "--steps", "1", "--name", "paired",
           "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, f"paired_commits failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    data = json.loads((tmp_path / "paired.json").read_text())
    trees = data["rounds"][0]["trees"]
    assert set(trees) == {"baseline", "candidate"}
    assert trees["baseline"]["loss_last"] == trees["candidate"]["loss_last"]
    assert all(t["median_s"] > 0 and t["median_cpu_s"] > 0 for t in trees.values())
    assert "| candidate |" in (tmp_path / "paired.md").read_text()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="the batch variant needs Linux's SCHED_BATCH")
def test_gloo_spin_smoke(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "benchmarks.gloo_spin", "--rounds", "1", "--warmup", "0", "--steps", "2",
           "--numel", "1000", "--name", "spin", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, f"gloo_spin failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    summary = json.loads((tmp_path / "spin.json").read_text())["summary"]
    assert set(summary) == {"torch", "batch"} and summary["torch"]["cpu_s_vs_torch"] == 1.0
    assert all(v["wall_s"] > 0 and v["cpu_s"] > 0 for v in summary.values())
    assert "| batch |" in (tmp_path / "spin.md").read_text()
