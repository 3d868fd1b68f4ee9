"""The README's API sketch runs as written: the first python block under "## The API", saved to a file and run with
`torchrun --standalone --nproc-per-node 4` (CPU: the sketch itself picks gloo when no GPU is visible), exits 0.
The meta-device block that follows it runs too, after the first (it uses its `topo`), without its
`sf.load_safetensors(model, "pretrained/")` line, marked optional, which needs a pretrained folder.

Both run with torch alone, as the README promises for the library (issue 33, item 2): each worker starts with
`torch_only.block()` (tests/torch_only.py), so numpy and every package torch does not require are missing, torch
included in that belief. After the sketch, the same workers take `model.state_dict()` (checked against the sketch's
`sf.full_state_dict`), `optimizer.state_dict()`, `model.load_state_dict()`, and a checkpoint save and load
(`sf.checkpoint`), whose model and optimizer states must come back as saved.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

from harness import REPO, clean_env, run_command

TIMEOUT_S = 240  # each run takes about 15 s on 2 cores, start-up included


def api_blocks() -> list[str]:
    """The python code blocks of README.md's "## The API" section, in order."""
    text = (REPO / "README.md").read_text()
    start = text.index("\n## The API\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end if end != -1 else len(text)], re.S)


TORCH_ONLY = f"""import sys
sys.path.insert(0, {str(REPO / "tests")!r})
import torch_only
torch_only.block()  # as after `pip install torch` and `pip install --no-deps shardfusion`: no numpy
"""

STATE_DICTS = """
torch_only.check_blocked()
state = model.state_dict()                                    # DTensors of the full shapes (collective)
for name, tensor in full.items():
    assert torch.equal(state[name].full_tensor(), tensor), name
saved = {k: {n: v.full_tensor() if hasattr(v, "full_tensor") else v for n, v in s.items()}
         for k, s in optimizer.state_dict()["state"].items()}
model.load_state_dict(state)
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints")
sf.checkpoint.save_checkpoint(model, optimizer, root, step=5)
with torch.no_grad():
    for p in model.parameters():
        p.zero_()
for s in optimizer.state.values():
    for v in s.values():
        v.zero_()
sf.checkpoint.load(model, optimizer, sf.checkpoint.latest_checkpoint(root))
assert all(torch.equal(t, full[n]) for n, t in sf.full_state_dict(model).items())
loaded = optimizer.state_dict()["state"]
for k, s in saved.items():
    for n, v in s.items():
        w = loaded[k][n]
        assert torch.equal(w.full_tensor() if hasattr(w, "full_tensor") else w, v), (k, n)
"""


def torchrun(script: str, tmp_path) -> None:
    path = tmp_path / "sketch.py"
    path.write_text(TORCH_ONLY + script)
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    result = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                          str(path)], TIMEOUT_S, env=env)
    assert result.returncode == 0, f"the README's sketch failed:\n{script}\n{result.stdout[-3000:]}\n" \
                                   f"{result.stderr[-5000:]}"


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_api_sketch_and_state_dicts_run_with_torch_alone(tmp_path):
    blocks = api_blocks()
    assert len(blocks) >= 2, "the API section should hold the sketch and the meta-device block"
    assert "for x, y in batches:" in blocks[0] and "batches = []" in blocks[0], "the sketch defines its batches"
    torchrun(blocks[0] + STATE_DICTS, tmp_path)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_meta_device_block_runs_after_the_sketch(tmp_path):
    sketch, meta = api_blocks()[:2]
    kept = [line for line in meta.splitlines() if "sf.load_safetensors(" not in line]
    assert len(kept) == len(meta.splitlines()) - 1, "only the optional load_safetensors line is left out"
    torchrun(sketch + "\n".join(kept) + "\n", tmp_path)
