"""Issue 41, item 7: routes on which an enabled ``"gnmr"`` block reached plain DeepSpeed unread and
unsaid, though ``gnmr_dist`` was imported (docs/deepspeed.md, "Nothing silent"):

* a Trainer without ``GNMRCallback`` in a script that imports ``gnmr_dist`` before transformers:
  ``import transformers`` probes ``importlib.util.find_spec("deepspeed")``, and the watch's
  import finder removed itself on that probe, so DeepSpeed, imported later by Trainer, was never
  wrapped;
* ``from deepspeed import initialize`` bound before ``import gnmr_dist``: the watch wrapped the
  ``deepspeed.initialize`` attribute, not the name the script held.

The watch now wraps ``DeepSpeedEngine.__init__`` and its finder stays until DeepSpeed's module
runs. Each route is a user's script under torchrun (the import order is the point, so it runs in
a fresh interpreter), with no logging set up: what a user sees on standard error."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.requires import require

require("deepspeed")
require("accelerate")

from tests import multiproc

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
UNREAD = 'gnmr: this DeepSpeed config has an enabled "gnmr" block, but its engine was built by '

MODEL = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM

def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))

def config(**extra):
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10_000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": 2},
            "gnmr": {"backend": "act_quant", "max_active": 2}, **extra}

def no_shm_build():  # DeepSpeed's CPU shared-memory op (a 90 s build) serves inference only
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
"""

TRAINER = """
import importlib.util, sys
import gnmr_dist  # the script uses gnmr_dist, but gives the Trainer no GNMRCallback
importlib.util.find_spec("deepspeed")  # what `import transformers` does (is it installed?)
from transformers import Trainer, TrainingArguments
assert "deepspeed" not in sys.modules  # the premise: DeepSpeed is imported by Trainer, later
import torch
from model import llama, config, no_shm_build

class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        ids = torch.arange(16) % 64
        return {"input_ids": ids, "labels": ids}

cfg = config(train_micro_batch_size_per_gpu="auto")
cfg["optimizer"]["params"]["lr"] = "auto"
args = TrainingArguments(output_dir=sys.argv[1], deepspeed=cfg, per_device_train_batch_size=2,
                         max_steps=1, report_to=[], save_strategy="no", disable_tqdm=True)
no_shm_build()
trainer = Trainer(model=llama(), args=args, train_dataset=Rows())
trainer.train()
print("engine has gnmr:", hasattr(trainer.model_wrapped, "gnmr"))
"""

BOUND = """
from deepspeed import initialize  # bound before gnmr_dist is imported
import gnmr_dist
import torch
from model import llama, config, no_shm_build

no_shm_build()
model = llama()
engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=config())
ids = torch.arange(32).reshape(2, 16) % 64
engine.backward(engine(input_ids=ids, labels=ids).loss)
engine.step()
print("engine has gnmr:", hasattr(engine, "gnmr"))
"""


def _run(tmp_path: Path, script: str) -> tuple[list[str], str]:
    """``script`` under torchrun (1 process) in ``tmp_path``: the GNMR warnings it wrote to
    standard error, and its standard output."""
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "script.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}", "OMP_NUM_THREADS": "1"}
    cmd = [*multiproc.torchrun(1), "script.py", str(tmp_path / "out")]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("gnmr:")]
    return said, done.stdout


def test_a_trainer_without_the_callback_is_warned_when_gnmr_dist_came_first(tmp_path):
    said, out = _run(tmp_path, TRAINER)
    assert "engine has gnmr: False" in out  # the premise: plain DeepSpeed trained
    (line,) = said  # once, on standard error, with no logging configured
    assert line.startswith(UNREAD)
    assert line.endswith(
        "so the block is ignored and GNMR is off. Give the Trainer callbacks=[GNMRCallback()] "
        "(from gnmr_dist import GNMRCallback), or call gnmr_dist.deepspeed.enable() before "
        "accelerator.prepare"
    )


def test_an_initialize_bound_before_gnmr_dist_is_watched(tmp_path):
    said, out = _run(tmp_path, BOUND)
    assert "engine has gnmr: False" in out
    (line,) = said
    assert line.startswith(UNREAD)
    assert line.endswith("Call gnmr_dist.deepspeed.initialize (the same arguments) instead")
