"""Optimizer state across a save and a resume: the field cases F9 and F10 (docs/field-cases.md) and optimizer state
beyond AdamW, each against the single-process reference.

F10: W=4 (I, O) = (2, 2), AdamW lr 1e-2, weight decay 0.1, the MLP, different data per rank. (a) The first update
from fresh state and the step count equal the reference. (b) 3 steps, save, load into fresh models at (2, 2) and
(4, 1), 2 more steps: parameters, exp_avg, exp_avg_sq and step equal the uninterrupted 5-step run (bitwise in the
same layout) and the reference. The same resume runs with SGD + momentum (momentum_buffer) and AdamW with amsgrad
(max_exp_avg_sq), and a checkpoint re-saved right after loading at (4, 1) equals the original bitwise.
F9: ZeroSizeModel at W=2 and W=4 (2, 2): step with clipping, save, load into a fresh model at the other world size;
shapes (0,) and (0, 4) survive, values and norm equal the reference, optimizer state (step) of every parameter
(the zero-element ones included) is restored, and a step after the load runs.
Also: frozen parameters (no optimizer state) stay without state after a load, and Python numbers in the optimizer
state come back as Python numbers.

Jobs: W=2 (F9 save), W=4 (every F10 / optimizer run, F9 save and load of the W=2 checkpoint), W=2 (F9 load of the
W=4 checkpoint). Checkpoint tensors are compared in this process through `checkpoint.read_all` (full tensors of the
original shapes).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from harness import run_distributed
from models import MODEL_SEED, build_model, concat_batches, loss_fn
from reference import (DATA_SEED, RTOL, Case, assert_bitwise, assert_close_dicts, draw_batch, get_topology,
                       make_optimizer, reference_train, wrap_kwargs)

JOB_TIMEOUT_S = 240
FIRST_STEP_RTOL, FIRST_STEP_ATOL = 1e-6, 1e-7  # F10 (a), fp32
ATOL_REL = 1e-6  # other comparisons with the reference: rtol RTOL, atol ATOL_REL * max |reference tensor|
FRESH_SEED = 7  # models that are loaded into start from other values than the saved run

F10 = Case(name="F10", model="mlp", world=4, sharding=4, outer=2, optim="adamw", lr=1e-2, steps=5)
# The resume runs: (I, O) = (2, 2) saves after 3 steps; fresh models at (2, 2) and (4, 1) load and run 2 more.
RESUME = {"adamw": F10, "sgd_momentum": F10.with_(name="sgd_momentum", optim="sgd_momentum", lr=0.05),
          "adamw_amsgrad": F10.with_(name="adamw_amsgrad", optim="adamw_amsgrad")}
SAVE_AT = 3
LOAD_LAYOUTS = ((2, 2), (4, 1))
F9 = {2: Case(name="F9-W2", model="zero_size", world=2, sharding=2, outer=1, optim="adamw", steps=1, units="none",
              clip=(1.0, 2.0)),
      4: Case(name="F9-W4", model="zero_size", world=4, sharding=4, outer=2, optim="adamw", steps=1, units="none",
              clip=(1.0, 2.0))}
STATELESS = Case(name="stateless", model="skip_frozen_a", world=4, sharding=4, outer=2, optim="adamw", steps=1)
PYTHON_NUMBERS = {"count": 3, "scale": 0.1, "flag": True}  # extra state entries of b.weight in that run
F9_SHAPES = {"a": (8,), "empty": (0,), "b": (24,), "lin.weight": (0, 4), "lin.bias": (0,)}


def _optimizer(case: Case, named_params) -> torch.optim.Optimizer:
    """The reference's optimizers plus the two whose state AdamW lacks (momentum_buffer, max_exp_avg_sq)."""
    params = [p for _, p in named_params]
    if case.optim == "sgd_momentum":
        return torch.optim.SGD(params, lr=case.lr, momentum=0.9)
    if case.optim == "adamw_amsgrad":
        return torch.optim.AdamW(params, lr=case.lr, weight_decay=0.1, amsgrad=True)
    return make_optimizer(case, [(str(i), p) for i, p in enumerate(params)])


def _checkpoint_keys(params: dict, state: dict) -> dict[str, torch.Tensor]:
    """{name: tensor} and {name: {key: value}} as `read_all` names them: model/<name>, optim/<name>/<key>."""
    out = {f"model/{n}": t for n, t in params.items()}
    out.update({f"optim/{n}/{k}": torch.as_tensor(v) for n, st in state.items() for k, v in st.items()})
    return out


# --- the single-process reference ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _reference(case: Case) -> list[dict]:
    """reference_train's loop (global batch, mean loss, same seeds) with `_optimizer`, reporting what it does not:
    after every step, {"norm", "keys": model/... and optim/... tensors as `read_all` names them}."""
    model = build_model(case.model)
    names = {id(p): n for n, p in model.named_parameters()}
    opt = _optimizer(case, model.named_parameters())
    gens = [torch.Generator().manual_seed(DATA_SEED + r + 1) for r in range(case.data_parallel)]
    out = []
    for _ in range(case.steps):
        loss_fn(case.model, model, concat_batches([draw_batch(case, g) for g in gens])).backward()
        norm = None
        if case.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], *case.clip)
        opt.step()
        opt.zero_grad()
        state = {names[id(p)]: {k: v.detach().clone() for k, v in st.items()} for p, st in opt.state.items()}
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append({"norm": None if norm is None else norm.item(), "keys": _checkpoint_keys(params, state)})
    return out


# --- workers ------------------------------------------------------------------------------------------------------


def _wrap(case: Case, seed: int):
    import shardfusion as sf

    model = sf.fully_shard(build_model(case.model, seed=seed), get_topology(case), **wrap_kwargs(case))
    return model, _optimizer(case, model.named_parameters())


def _batches(case: Case) -> list[dict]:
    """This rank's micro-batch of every step (data-parallel rank r draws from seed DATA_SEED + r + 1)."""
    gen = torch.Generator().manual_seed(DATA_SEED + get_topology(case).data_parallel_rank + 1)
    return [draw_batch(case, gen) for _ in range(case.steps)]


def _step(case: Case, model, opt, batch: dict):
    """One step; returns the clipping norm (None without clipping)."""
    import shardfusion as sf

    loss_fn(case.model, model, batch).backward()
    norm = sf.clip_grad_norm_(model, *case.clip).item() if case.clip is not None else None
    opt.step()
    opt.zero_grad()
    return norm


def _state_summary(model, opt) -> dict[str, dict]:
    """{name: {key: float for scalars, shape for tensors}} of this rank's optimizer state ({} without state)."""
    return {n: {k: float(v) if torch.as_tensor(v).dim() == 0 else tuple(v.shape) for k, v in opt.state[p].items()}
            if p in opt.state else {} for n, p in model.named_parameters()}


def _resume_runs(name: str, case: Case, root: str) -> dict:
    """Uninterrupted run at (2, 2) (saved after SAVE_AT and after all steps); fresh models at LOAD_LAYOUTS load the
    first checkpoint and finish the run; the (4, 1) one is also re-saved right after loading. Checkpoints are
    named `<name>-...`."""
    import shardfusion as sf
    from shardfusion import checkpoint as ckpt

    batches = _batches(case)
    model, opt = _wrap(case, seed=MODEL_SEED)
    out = {"init": sf.full_state_dict(model)}
    for s, batch in enumerate(batches):
        _step(case, model, opt, batch)
        if s == 0:
            out["after_first"] = sf.full_state_dict(model)
            out["first_state"] = _state_summary(model, opt)
        if s + 1 == SAVE_AT:
            ckpt.save(model, opt, os.path.join(root, f"{name}-at{SAVE_AT}"))
    ckpt.save(model, opt, os.path.join(root, f"{name}-uninterrupted"))
    for inner, outer in LOAD_LAYOUTS:
        layout = case.with_(outer=outer, sharding=inner * outer)
        model, opt = _wrap(layout, seed=FRESH_SEED)
        ckpt.load(model, opt, os.path.join(root, f"{name}-at{SAVE_AT}"))
        if (inner, outer) == (4, 1):
            ckpt.save(model, opt, os.path.join(root, f"{name}-resaved-I{inner}O{outer}"))
        for batch in batches[SAVE_AT:]:
            _step(layout, model, opt, batch)
        ckpt.save(model, opt, os.path.join(root, f"{name}-resumed-I{inner}O{outer}"))
    return out


def _f9_save(case: Case, root: str) -> dict:
    """F9: one step with clipping, then save to `root/<case name>`; returns the norm."""
    from shardfusion import checkpoint as ckpt

    model, opt = _wrap(case, seed=MODEL_SEED)
    out = {"norm": _step(case, model, opt, _batches(case)[0])}
    ckpt.save(model, opt, os.path.join(root, case.name))
    return out


def _f9_load(case: Case, root: str, load_from: str) -> dict:
    """F9: a fresh model of `case` loads `root/<load_from>` and steps once (on its second batch)."""
    import shardfusion as sf
    from shardfusion import checkpoint as ckpt

    model, opt = _wrap(case, seed=FRESH_SEED)
    ckpt.load(model, opt, os.path.join(root, load_from))
    out = {"loaded": sf.full_state_dict(model), "loaded_state": _state_summary(model, opt)}
    out["norm_after_load"] = _step(case, model, opt, _batches(case.with_(steps=2))[1])
    return out


def _stateless_run(root: str) -> dict:
    """A frozen parameter never gets optimizer state: saved without it, it has none after a load, also when the
    loading optimizer had some for it. Python numbers in the state come back as Python numbers."""
    from shardfusion import checkpoint as ckpt

    case = STATELESS
    model, opt = _wrap(case, seed=MODEL_SEED)
    _step(case, model, opt, _batches(case)[0])
    opt.state[dict(model.named_parameters())["b.weight"]].update(PYTHON_NUMBERS)
    path = os.path.join(root, case.name)
    ckpt.save(model, opt, path)
    model, opt = _wrap(case.with_(outer=1), seed=FRESH_SEED)
    params = dict(model.named_parameters())
    opt.state[params["a.weight"]]["momentum_buffer"] = torch.zeros_like(params["a.weight"])  # stale, not saved
    ckpt.load(model, opt, path)
    numbers = {k: v for k, v in opt.state[params["b.weight"]].items() if k in PYTHON_NUMBERS}
    return {"saved_kinds": ckpt.read_meta(path)["optim_state"], "loaded_state": _state_summary(model, opt),
            "numbers": {k: (type(v).__name__, v) for k, v in numbers.items()}}


def _w4_job(root: str) -> dict:
    out = {name: _resume_runs(name, case, root) for name, case in RESUME.items()}
    out["stateless"] = _stateless_run(root)
    out["F9"] = {**_f9_save(F9[4], root), **_f9_load(F9[4], root, load_from=F9[2].name)}
    return out


def _w2_save_job(root: str) -> dict:
    return _f9_save(F9[2], root)


def _w2_load_job(root: str) -> dict:
    return _f9_load(F9[2], root, load_from=F9[4].name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt-cases"))
    w2_save = run_distributed(_w2_save_job, 2, root, timeout=JOB_TIMEOUT_S)
    w4 = run_distributed(_w4_job, 4, root, timeout=JOB_TIMEOUT_S)
    w2_load = run_distributed(_w2_load_job, 2, root, timeout=JOB_TIMEOUT_S)
    return root, w2_save, w4, w2_load


def _read(root: str, name: str) -> dict[str, torch.Tensor]:
    from shardfusion import checkpoint as ckpt

    return ckpt.read_all(os.path.join(root, name))


def _assert_close_scaled(actual: dict, expected: dict, what: str) -> None:
    """assert_close_dicts with atol relative to each tensor's magnitude (ATOL_REL * max |expected|), so that small
    state (exp_avg_sq ~1e-4) is compared as strictly as parameters ~1e-1."""
    for k, e in expected.items():
        atol = ATOL_REL * float(e.abs().max()) if e.numel() else 0.0
        assert_close_dicts(actual, expected, what, rtol=RTOL, atol=atol, names=[k])


# --- tests ----------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_reference_loop_matches_shared_reference():
    """`_reference` (which also reports optimizer state) is the shared reference_train, bitwise."""
    for case in (F10, F9[2], F9[4]):
        ours, shared = _reference(case), reference_train(case)
        for step, params in enumerate(shared["params"]):
            assert_bitwise({k[6:]: t for k, t in ours[step]["keys"].items() if k.startswith("model/")}, params,
                            f"{case.name} step {step}")
        assert [s["norm"] for s in ours] == (shared["norms"] or [None] * case.steps)


@pytest.mark.timeout(3 * JOB_TIMEOUT_S + 60)
def test_f10_first_step_from_fresh_state(runs):
    """F10 (a): the first AdamW update equals the reference's; every rank's state has step exactly 1 for every
    parameter it holds."""
    _, _, w4, _ = runs
    ref = _reference(F10)[0]["keys"]
    init = build_model("mlp").state_dict()
    for r, result in enumerate(w4):
        run = result["adamw"]
        for n, p0 in init.items():
            torch.testing.assert_close(run["after_first"][n] - run["init"][n], ref[f"model/{n}"] - p0,
                                       rtol=FIRST_STEP_RTOL, atol=FIRST_STEP_ATOL, msg=lambda m: f"rank {r} {n}: {m}")
        assert run["first_state"].keys() == init.keys()
        for n, st in run["first_state"].items():
            assert st["step"] == 1.0 and set(st) == {"step", "exp_avg", "exp_avg_sq"}, (r, n, st)


@pytest.mark.timeout(3 * JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", sorted(RESUME))
def test_resume_equals_uninterrupted(runs, name):
    """F10 (b) and the same with SGD momentum and AdamW amsgrad: save after 3 steps, load into fresh (2, 2) and
    (4, 1) models, 2 more steps. Every checkpoint key (parameters and all optimizer state) equals the uninterrupted
    run's: bitwise at (2, 2), to rounding at (4, 1) (another reduction order); all equal the reference; step is 5."""
    root = runs[0]
    case = RESUME[name]
    whole = _read(root, f"{name}-uninterrupted")
    ref = _reference(case)[-1]["keys"]
    assert set(ref) == set(whole), sorted(set(ref) ^ set(whole))
    _assert_close_scaled(whole, ref, f"{name}: uninterrupted vs reference")
    for inner, outer in LOAD_LAYOUTS:
        resumed = _read(root, f"{name}-resumed-I{inner}O{outer}")
        if (inner, outer) == (2, 2):
            assert_bitwise(resumed, whole, f"{name}: resumed at (2, 2) vs uninterrupted")
        assert set(resumed) == set(whole)
        _assert_close_scaled(resumed, whole, f"{name}: resumed at ({inner}, {outer}) vs uninterrupted")
        _assert_close_scaled(resumed, ref, f"{name}: resumed at ({inner}, {outer}) vs reference")
        steps = {float(t) for k, t in resumed.items() if k.endswith("/step")}
        assert steps == (set() if name == "sgd_momentum" else {float(case.steps)}), steps


@pytest.mark.timeout(3 * JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("name", sorted(RESUME))
def test_state_round_trips_bitwise(runs, name):
    """Loaded at (4, 1) and saved again at once: every key equals the (2, 2) checkpoint bitwise; the optimizer's own
    state keys (momentum_buffer, max_exp_avg_sq, ...) are the ones stored."""
    root = runs[0]
    saved = _read(root, f"{name}-at{SAVE_AT}")
    assert_bitwise(_read(root, f"{name}-resaved-I4O1"), saved, f"{name}: re-saved at (4, 1)")
    keys = {k.rsplit("/", 1)[1] for k in saved if k.startswith("optim/")}
    assert keys == {"adamw": {"step", "exp_avg", "exp_avg_sq"}, "sgd_momentum": {"momentum_buffer"},
                    "adamw_amsgrad": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}}[name], keys


@pytest.mark.timeout(3 * JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("world", sorted(F9))
def test_f9_zero_element_params_save_and_load(runs, world):
    """F9: the norm equals the reference's; the checkpoint holds the original shapes (0-element ones too) with the
    reference's values; a fresh model at the other world size loads it (values bitwise, every parameter's state
    restored with step 1 on every rank) and steps again."""
    from shardfusion import checkpoint as ckpt

    root, w2_save, w4, w2_load = runs
    case = F9[world]
    saved_by = {2: w2_save, 4: [r["F9"] for r in w4]}[world]
    loaded_by = {2: [r["F9"] for r in w4], 4: w2_load}[world]
    ref = _reference(case)[0]
    for r in saved_by:
        torch.testing.assert_close(r["norm"], ref["norm"], rtol=1e-5, atol=0)
    full = ckpt.load_full(os.path.join(root, case.name))
    assert {n: tuple(t.shape) for n, t in full.items()} == F9_SHAPES
    stored = _read(root, case.name)
    assert set(stored) == set(ref["keys"]), sorted(set(stored) ^ set(ref["keys"]))
    _assert_close_scaled(stored, ref["keys"], f"{case.name} checkpoint vs reference")
    assert tuple(stored["optim/lin.weight/exp_avg"].shape) == (0, 4) and float(stored["optim/empty/step"]) == 1.0
    for rank, r in enumerate(loaded_by):
        assert_bitwise(r["loaded"], full, f"{case.name} loaded at W={6 - world}, rank {rank}")
        for n, st in r["loaded_state"].items():
            assert st["step"] == 1.0 and set(st) == {"step", "exp_avg", "exp_avg_sq"}, (rank, n, st)
        assert r["norm_after_load"] is not None and r["norm_after_load"] == loaded_by[0]["norm_after_load"]


@pytest.mark.timeout(3 * JOB_TIMEOUT_S + 60)
def test_parameter_without_state_stays_without(runs):
    """The frozen a.weight / a.bias have no optimizer state when saved; after a load into a fresh (4, 1) model they
    have none either (a stale entry is dropped), while every other parameter has AdamW's state with step 1. Python
    numbers added to b.weight's state are saved with their kinds and come back as the same Python numbers."""
    _, _, w4, _ = runs
    for rank, r in enumerate(w4):
        kinds, state = r["stateless"]["saved_kinds"], r["stateless"]["loaded_state"]
        assert set(kinds) == {"b.weight", "b.bias", "head.weight", "head.bias"}, sorted(kinds)
        assert {n for n, st in state.items() if st} == set(kinds), (rank, state)
        assert all(st["step"] == 1.0 for st in state.values() if st), (rank, state)
        assert kinds["b.weight"] == {"step": "tensor", "exp_avg": "element", "exp_avg_sq": "element",
                                     "count": "int", "scale": "float", "flag": "bool"}, kinds["b.weight"]
        assert r["stateless"]["numbers"] == {k: (type(v).__name__, v) for k, v in PYTHON_NUMBERS.items()}
