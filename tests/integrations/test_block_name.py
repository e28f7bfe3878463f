"""A misspelt ``"gnmr"`` block is refused by name on every route; no unrelated key is (issue 33).

Without the check, DeepSpeed ignores an unknown top-level key and GNMR finds no block: a config
with ``"gmnr"`` trained plain DeepSpeed in a user's script, observe-only under
``gnmr-ds-pretrain``, and ``gnmr-launch check`` called it valid. The fuzz below sends 1,000
near-misses and 1,000 unrelated keys through ``gnmr-launch check`` and through
``gnmr_dist.deepspeed.initialize`` in a real (one-process, gloo) world.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import string
from pathlib import Path

import pytest

from gnmr_dist.integrations.config import check_block_name, looks_like_block
from gnmr_dist.train import launch
from tests import multiproc
from tests.integrations.deepspeed import common as dsc


def _levenshtein(a: str, b: str) -> int:
    """Plain edit distance (no swaps), independent of the code under test."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def near_misses(n: int = 1000) -> list[str]:
    """``n`` keys a user could have meant as ``"gnmr"``: one edit (insert, delete, substitute,
    swap), another case, its letters reordered, separators and words around it."""
    word, chars = "gnmr", string.ascii_lowercase + string.digits + "_-"
    edits = {word[:i] + c + word[i:] for i in range(5) for c in chars}
    edits |= {word[:i] + word[i + 1 :] for i in range(4)}
    edits |= {word[:i] + c + word[i + 1 :] for i in range(4) for c in chars}
    edits |= {word[:i] + word[i + 1] + word[i] + word[i + 2 :] for i in range(3)}
    cases = {"".join(c) for c in itertools.product(*((x, x.upper()) for x in word))}
    edits |= {e.upper() for e in edits} | {e.capitalize() for e in edits}
    edits |= cases | {"".join(p) for p in itertools.permutations(word)}
    around = ("", "_", "-", " ", ".")
    words = ("", "_block", "Config", "_settings", "s")
    edits |= {f"{a}{c}{w}" for a in around for c in cases for w in words}
    edits.discard(word)
    must = {"gmnr", "GNMR", "gnm", "gnmrr", "gnmr_block", "gmrn"}  # the issue's and the docs'
    rest = random.Random(33).sample(sorted(edits - must), n - len(must))
    return sorted(must | set(rest))


def deepspeed_keys() -> set[str]:
    """DeepSpeed's own top-level config keys: its constants, and the blocks it documents."""
    from deepspeed.runtime import constants

    keys = {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)}
    blocks = {"zero_optimization", "activation_checkpointing", "flops_profiler", "tensorboard"}
    blocks |= {"wandb", "csv_monitor", "comms_logger", "aio", "elasticity", "compression_training"}
    return {k for k in keys if k.isidentifier() and k.islower()} | blocks


def unrelated_keys(n: int = 1000) -> list[str]:
    """Random identifiers at least 3 edits from ``"gnmr"`` that neither contain it nor reorder
    its letters (keys DeepSpeed ignores, so a whole config of them trains)."""
    rng, keys = random.Random(33), set[str]()
    while len(keys) < n:
        key = "x_" + "".join(rng.choices(string.ascii_lowercase + "_", k=rng.randint(2, 12)))
        letters = key.replace("_", "")
        far = _levenshtein(key, "gnmr") >= 3 and "gnmr" not in letters
        if far and sorted(letters) != sorted("gnmr"):
            keys.add(key)
    return sorted(keys)


def test_the_fuzz_sets_are_what_they_claim():
    near, far = near_misses(), unrelated_keys()
    assert len(set(near)) == len(set(far)) == 1000 and not set(near) & set(far)
    assert {"gmnr", "GNMR", "gnm", "gnmrr", "gnmr_block", "gmrn"} <= set(near)
    assert {"gradient_clipping", "zero_optimization", "bf16", "optimizer"} <= deepspeed_keys()


def test_every_near_miss_is_named_with_the_fix_and_no_other_key_is():
    assert [k for k in near_misses() if not looks_like_block(k)] == []
    assert [k for k in unrelated_keys() + sorted(deepspeed_keys()) if looks_like_block(k)] == []
    with pytest.raises(ValueError) as err:
        check_block_name({"gmnr": {}, "GNMR": {}, "bf16": {}}, "ds.json")
    assert str(err.value) == (
        "ds.json: unknown top-level key 'gmnr', 'GNMR'; did you mean 'gnmr'? GNMR reads its "
        'settings only from a block named exactly "gnmr": rename the key (or remove it to train '
        "without GNMR)"
    )
    check_block_name({"gnmr": {}, "gnmr_block": {}}, "ds.json")  # the block is there: no guess


def _ds_config(block_key: str, **extra: object) -> dict[str, object]:
    """The DeepSpeed tests' config with the block under ``block_key``."""
    return dsc.ds_config(0, **{block_key: {"backend": "act_quant", "max_active": 2}}, **extra)


def test_gnmr_launch_check_refuses_each_near_miss_and_no_unrelated_key(tmp_path, capsys):
    path = tmp_path / "ds.json"
    missed = []
    for key in near_misses():
        path.write_text(json.dumps(_ds_config(key)))
        status = launch.main(["check", "--world-size", "1", str(path)])
        named = f"unknown top-level key {key!r}; did you mean 'gnmr'?" in capsys.readouterr().err
        if status != 2 or not named:
            missed.append(key)
    assert missed == []
    path.write_text(json.dumps(_ds_config("gnmr", **dict.fromkeys(unrelated_keys(), 0))))
    assert launch.main(["check", "--world-size", "1", str(path)]) == 0, capsys.readouterr().err


def test_a_megatron_gnmr_config_with_a_misspelt_block_is_refused(tmp_path, capsys):
    from gnmr_dist.train.megatron_flags import gnmr_block

    path = tmp_path / "gnmr.json"
    path.write_text(json.dumps({"gnmR": {"backend": "act_quant"}}))
    args = argparse.Namespace(gnmr_config=str(path), gnmr_backend=None, gnmr_trace=None)
    with pytest.raises(ValueError, match=r"--gnmr-config .*gnmr.json: unknown top-level key"):
        gnmr_block(args, check_host=False)


def _initialize_worker(rank: int, world: int, near: list[str], far: list[str]):
    import gnmr_dist.deepspeed as gds

    dsc.no_shm_build()
    refused = 0
    for key in near:
        try:
            gds.initialize(model=dsc.llama(), config=_ds_config(key))
        except ValueError as err:
            refused += "gnmr_dist.deepspeed.initialize: the DeepSpeed config: unknown" in str(err)
    engine, *_ = gds.initialize(model=dsc.llama(), config=_ds_config("gnmr", **far))
    return refused, engine.gnmr is not None


def test_deepspeed_initialize_refuses_every_near_miss_before_deepspeed_runs():
    far = dict.fromkeys(unrelated_keys(), 0)
    refused, has_gnmr = multiproc.run(_initialize_worker, 1, near_misses(), far)[0]
    assert refused == 1000 and has_gnmr


def _trainer_worker(rank: int, world: int, path: str) -> str:
    """``GNMRCallback`` at the start of training with Trainer's own arguments for ``path``."""
    from transformers import TrainingArguments

    from gnmr_dist import GNMRCallback

    args = TrainingArguments(output_dir=str(Path(path).parent), deepspeed=path, report_to=[])
    callback = GNMRCallback()
    try:
        callback.on_train_begin(args, None, None)
    except ValueError as err:
        return str(err)
    finally:
        callback.on_train_end(args, None, None)
    return "not refused"


def test_trainer_callback_refuses_a_misspelt_block(tmp_path):
    path = Path(tmp_path, "ds.json")
    path.write_text(json.dumps(_ds_config("Gnmr")))
    message = multiproc.run(_trainer_worker, 1, str(path))[0]
    assert message.startswith("GNMRCallback: the DeepSpeed config: unknown top-level key 'Gnmr'")
