"""Export: `python -m shardfusion.export CKPT OUT` writes safetensors that a plain single-process model loads (no
shardfusion needed) with outputs equal to the sharded model's; a full state dict (that export) loads back into a
sharded model of another layout; a missing key raises on every rank. The command line refuses (exit 2, one line on
stderr) an unreadable checkpoint, a truncated data file, a run folder that saved no checkpoint, and an OUT holding
model.safetensors or config.json already (unless --overwrite). The tokenizer beside the weights is the one the
checkpoint's `extra` names (the record the training job fills; a checkpoint saved before records: the run folder's
copy), found relative to the checkpoint.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from harness import REPO, run_distributed, start_command
from models import Block, TinyTransformer, make_batch

RUN_BEFORE_TRAINER = REPO / "tests" / "fixtures" / "run-before-trainer"  # a byte-level GPT run, no tokenizer/

def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), sorted(a.keys() ^ b.keys())


def _save_job(root: str) -> dict:
    import shardfusion as sf
    from shardfusion import checkpoint as ckpt

    topo = sf.Topology(sharding=4, fsdp_outer_degree=2, timeout=60)
    torch.manual_seed(0)
    model = sf.fully_shard(TinyTransformer(), topo, units=(Block,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = make_batch("transformer", torch.Generator().manual_seed(1 + topo.rank))
    torch.nn.functional.cross_entropy(model(batch["x"]).reshape(-1, 16), batch["y"].reshape(-1)).backward()
    opt.step()
    ckpt.save_checkpoint(model, opt, root, 1)
    x = make_batch("transformer", torch.Generator().manual_seed(99))["x"]
    with torch.no_grad():
        return {"logits": model(x), "x": x}


def _import_job(export_dir: str) -> dict:
    from safetensors.torch import load_file
    import shardfusion as sf
    from shardfusion import checkpoint as ckpt

    topo = sf.Topology(sharding=2, timeout=60)  # another layout: W=2, plain FSDP
    torch.manual_seed(123)  # other initial values
    model = sf.fully_shard(TinyTransformer(), topo, units=(Block,))
    full = load_file(os.path.join(export_dir, "model.safetensors"))
    ckpt.load_full_state(model, full)
    x = make_batch("transformer", torch.Generator().manual_seed(99))["x"]
    with torch.no_grad():
        logits = model(x)
    del full["pos"]
    try:
        ckpt.load_full_state(model, full)
    except ValueError as e:
        error = str(e)
    else:
        error = None
    return {"logits": logits, "error": error}


@pytest.mark.timeout(300)
def test_export_loads_in_plain_pytorch_and_back_into_sharded(tmp_path, capsys):
    root, out = tmp_path / "ckpt", tmp_path / "export"
    saved = run_distributed(_save_job, 4, str(root), timeout=120)
    proc = subprocess.run([sys.executable, "-m", "shardfusion.export", str(root), str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    # a plain single-process model, loaded with safetensors only
    code = ("import sys, torch; sys.path.insert(0, 'tests'); from safetensors.torch import load_file; "
            "from models import TinyTransformer; m = TinyTransformer(); "
            f"missing, unexpected = m.load_state_dict(load_file({str(out / 'model.safetensors')!r}), strict=False); "
            "assert set(missing) <= {'head.weight'} and not unexpected, (missing, unexpected); "
            f"x = torch.load({str(tmp_path / 'x.pt')!r}); torch.save(m(x).detach(), {str(tmp_path / 'plain.pt')!r})")
    torch.save(saved[0]["x"], tmp_path / "x.pt")
    # the plain model's command and an export of no checkpoint (into OUT, which holds the export now) run beside
    # the import job (each command is mostly a Python start-up importing torch)
    plain_model = start_command([sys.executable, "-c", code], 120, env={**os.environ, "PYTHONPATH": str(REPO)})
    bad = start_command([sys.executable, "-m", "shardfusion.export", str(tmp_path / "nothing"), str(out)], 120,
                        env=dict(os.environ))
    back = run_distributed(_import_job, 2, str(out), timeout=120)
    proc = plain_model.finish()
    assert proc.returncode == 0, proc.stderr[-2000:]
    plain = torch.load(tmp_path / "plain.pt")
    torch.testing.assert_close(plain, saved[0]["logits"], rtol=1e-5, atol=1e-6)
    for r in back:
        torch.testing.assert_close(r["logits"], saved[0]["logits"], rtol=1e-5, atol=1e-6)
        assert r["error"] is not None and "missing: ['pos']" in r["error"], r["error"]
    bad = bad.finish()
    assert bad.returncode == 2 and "not readable" in bad.stderr, bad.stderr[-1000:]
    # the rest in this process (main, not a subprocess: no second torch start-up)
    from safetensors.torch import load_file
    from shardfusion import export

    def cli_error(*argv: str) -> str:
        """main(argv)'s stderr, which must be one line, after exiting with status 2."""
        capsys.readouterr()
        with pytest.raises(SystemExit) as info:
            export.main(list(argv))
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, (info.value.code, err)
        return err
    # existing output files are not replaced without --overwrite (here: a run folder with its own config.json)
    err = cli_error(str(root), str(out))
    assert f"{str(out / 'model.safetensors')!r} exists" in err and "--overwrite" in err, err
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text('{"job": "training"}')
    err = cli_error(str(root), str(run_dir))
    assert f"{str(run_dir / 'config.json')!r} exists" in err, err
    assert (run_dir / "config.json").read_text() == '{"job": "training"}'
    assert not (run_dir / "model.safetensors").exists()
    assert export.main([str(root), str(run_dir), "--overwrite"]) == 0
    exported = load_file(str(out / "model.safetensors"))
    _assert_equal(load_file(str(run_dir / "model.safetensors")), exported)
    # no checkpoint there at all: one line (DCP is not even asked, so it logs no traceback)
    err = cli_error(str(tmp_path / "nowhere"), str(tmp_path / "export-nowhere"))
    assert "nowhere' is not readable: it does not exist" in err, err
    # a truncated data file: a usage error naming the checkpoint and the file, not DCP's traceback
    damaged = tmp_path / "damaged"
    shutil.copytree(root / "step-1", damaged)
    os.truncate(damaged / "__1_0.distcp", 100)
    err = cli_error(str(damaged), str(tmp_path / "export-damaged"))
    assert f"checkpoint {str(damaged)!r} cannot be read: __1_0.distcp has 100 bytes" in err, err


def test_export_takes_the_tokenizer_the_checkpoint_names(tmp_path, capsys):
    from shardfusion.checkpoint import export_tokenizer as et, read_meta
    from shardfusion.checkpoint.export import export
    from shardfusion.train import run_folder

    # the record the job writes: a copy in OUT/tokenizer for every tokenizer but bytes, relative to the checkpoint
    assert run_folder.tokenizer_extra("bytes") == run_folder.tokenizer_extra(None) == {
        "tokenizer": {"folder": None, "bytes": True}}
    assert run_folder.tokenizer_extra("/data/bpe") == {
        "tokenizer": {"folder": os.path.join("..", "..", run_folder.TOKENIZER), "bytes": False}}
    extra = run_folder.tokenizer_extra("/data/bpe")
    assert et.saved_record(extra) == extra["tokenizer"] and et.saved_record({"step": 1}) == et.record(None, False)
    run = tmp_path / "moved-run"  # the folder is found relative to the checkpoint, wherever the run lies now
    (run / run_folder.CHECKPOINTS / "step-3").mkdir(parents=True)
    assert et.tokenizer_folder(str(run / run_folder.CHECKPOINTS / "step-3"), extra["tokenizer"]) is None
    (run / run_folder.TOKENIZER).mkdir()
    assert et.tokenizer_folder(str(run / run_folder.CHECKPOINTS / "step-3"), extra["tokenizer"]) == str(
        run / run_folder.TOKENIZER)
    # a checkpoint saved before records (by the job, on bytes): the run folder's tokenizer/, as before
    step = RUN_BEFORE_TRAINER / "checkpoints" / "step-4"
    assert et.saved_record(read_meta(str(step))["extra"]) == et.record(os.path.join("..", "..", "tokenizer"), True)
    old_run = tmp_path / "old-run"
    shutil.copytree(RUN_BEFORE_TRAINER, old_run)
    export(str(old_run), str(tmp_path / "plain"))  # a GPT on bytes without tokenizer/: the weights alone
    assert sorted(os.listdir(tmp_path / "plain")) == ["config.json", "model.safetensors"]
    (old_run / "tokenizer").mkdir()
    (old_run / "tokenizer" / "tokenizer.json").write_text('{"kept": "as saved"}')
    export(str(old_run), str(tmp_path / "with-tokenizer"))
    assert (tmp_path / "with-tokenizer" / "tokenizer.json").read_text() == '{"kept": "as saved"}'
    # a run folder that saved no checkpoint: one line that says so
    shutil.rmtree(old_run / "checkpoints")
    with pytest.raises(ValueError, match="no published checkpoint .* lies under it"):
        export(str(old_run), str(tmp_path / "none"))
