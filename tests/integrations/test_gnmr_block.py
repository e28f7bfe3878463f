"""The "gnmr" block: strict parsing, failures before training, and the disabled/plain paths."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.requires import require

require("deepspeed")

from gnmr_dist.core import GNMRConfig
from gnmr_dist.integrations.config import GNMRBlock
from tests import multiproc
from tests.integrations.deepspeed import common as dsc


def test_defaults_and_full_block():
    assert GNMRBlock.from_dict(None).enabled is False
    block = GNMRBlock.from_dict(
        {
            "backend": "fp8_emulated",
            "units": "layer",
            "exclude": ["*.layers.0"],
            "max_active": 2,
            "alpha": {"schedule": "linear", "start": 3, "end": 1.5, "steps": 100},
            "low_cost": {"format": "e3m2"},
            "log": {"trace": "t.jsonl", "every": 5},
            "on_missing_state": "fresh",
        }
    )
    assert block.enabled and block.backend == "fp8_emulated" and block.units == "layer"
    assert block.policy.max_active == 2 and block.policy.thresholds_at(1)[0] == 3.0
    assert block.log.every == 5 and block.exclude == ("*.layers.0",)


@pytest.mark.parametrize(
    "block, match",
    [
        ({"max_actve": 2}, r"unknown key gnmr\.max_actve; did you mean 'max_active'"),
        ({"backnd": "int8"}, r"unknown key gnmr\.backnd; did you mean 'backend'"),
        ({"max_active": -1}, r"gnmr\.max_active must be an integer >= 0, got -1"),
        ({"backend": "fp8"}, r"gnmr\.backend: unknown backend 'fp8'; did you mean 'te_fp8'"),
        ({"units": "block"}, r"gnmr\.units must be one of \['operator', 'layer'\]"),
        ({"log": {"evry": 2}}, r"unknown key gnmr\.log\.evry; did you mean 'every'"),
        ({"log": {"every": 0}}, r"gnmr\.log\.every must be an integer >= 1"),
        ({"include": "layers.*"}, r"gnmr\.include must be a list of glob patterns"),
        ({"enabled": "yes"}, r"gnmr\.enabled must be true or false"),
        ({"on_missing_state": "ignore"}, r"gnmr\.on_missing_state must be one of"),
        ({"window": 0}, r"gnmr\.window must be an integer >= 1"),
        ({"error_every": 0, "gamma": 1.0}, r"gnmr\.error_every must be an integer >= 1"),
        ({"error_every": 4}, r"gnmr\.error_every=4 needs gnmr\.gamma"),
    ],
)
def test_invalid_blocks_name_the_key(block, match):
    with pytest.raises(ValueError, match=match):
        GNMRBlock.from_dict(block)


def test_error_every_defaults_to_every_step():
    assert GNMRBlock.from_dict({}).error_every == 1
    block = {"backend": "act_quant", "gamma": 0.5, "error_every": 10}
    assert GNMRBlock.from_dict(block).error_every == 10


@pytest.mark.parametrize(
    "block, match",
    [
        (
            {"backend": "act_quant", "low_cost": {"bitz": 4}},
            r"unknown key gnmr\.low_cost\.bitz; did you mean 'bits'",
        ),
        ({"backend": "nope"}, r"unknown backend 'nope'"),
        ({"max_active": -3}, r"gnmr\.max_active"),
        (
            {"gamma": 0.5},  # no backend: nothing measures the damage term's error sums
            r"gnmr\.gamma scores the damage term .* gnmr\.backend=null \(observe only\) runs no "
            r"low-cost path to measure",
        ),
    ],
)
def test_initialize_fails_before_any_training_or_process_group(block, match):
    import torch.distributed as dist

    import gnmr_dist.deepspeed as gds

    with pytest.raises(ValueError, match=match):
        gds.initialize(model=nn.Linear(4, 4), config=dsc.ds_config(0, gnmr=block))
    assert not dist.is_initialized()  # nothing started


def test_unsupported_setups_fail_before_any_process_group():
    import torch.distributed as dist

    import gnmr_dist.deepspeed as gds

    for stage, device in ((3, "cpu"), (2, "nvme")):
        cfg = dsc.ds_config(stage, gnmr={"backend": "act_quant"})
        cfg["zero_optimization"]["offload_optimizer"] = {"device": device}
        said = rf"offload_optimizer\.device='{device}' at ZeRO stage {stage} is not supported"
        with pytest.raises(NotImplementedError, match=said):
            gds.initialize(model=nn.Linear(4, 4), config=cfg)

    class TP2:
        def get_model_parallel_world_size(self):
            return 2

    with pytest.raises(NotImplementedError, match="model-parallel mpu"):
        gds.initialize(model=nn.Linear(4, 4), mpu=TP2(), config=dsc.ds_config(0, gnmr={}))
    typo = {"backend": "act_quant", "include": ["*.layer.*"]}  # "layers"
    said = (
        r"include=\['\*\.layer\.\*'\], exclude=\[\]; the model's operator units are: "
        r"model\.layers\.0\.self_attn\.q_proj, "
        r"model\.layers\.0\.self_attn\.k_proj"
    )
    with pytest.raises(ValueError, match=said):
        gds.initialize(model=dsc.llama(), config=dsc.ds_config(0, gnmr=typo))
    assert not dist.is_initialized()


def _nothing_eligible_worker(rank, world):
    import gnmr_dist.deepspeed as gds

    dsc.no_shm_build()
    model = Plain()
    model.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Tanh()) for _ in range(3))
    try:
        gnmr = {"backend": "act_quant", "units": "layer"}  # layers without any linear operator
        gds.initialize(model=model, config=dsc.ds_config(0, gnmr=gnmr))
    except ValueError as err:
        return str(err)
    return None


def test_a_backend_that_supports_no_unit_is_an_error():
    (msg,) = multiproc.run(_nothing_eligible_worker, 1)
    assert msg is not None and "'act_quant' backend supports none of the 3 units" in msg


def test_config_file_path_is_read(tmp_path):
    from gnmr_dist.integrations.deepspeed import load_ds_config

    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "gnmr": {"max_active": 1}}')
    assert load_ds_config(str(path))["gnmr"] == {"max_active": 1}
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_ds_config(str(tmp_path / "missing.json"))


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x).square().mean()


def _plain_worker(rank, world):
    import gnmr_dist.deepspeed as gds

    dsc.no_shm_build()
    torch.manual_seed(0)
    off, *_ = gds.initialize(model=Plain(), config=dsc.ds_config(2, gnmr={"enabled": False}))
    on, *_ = gds.initialize(
        model=Plain(), config=dsc.ds_config(2, gnmr={"backend": "fp8_emulated", "warmup_steps": 0})
    )
    for step in range(3):
        x = torch.randn(2, 16, generator=torch.Generator().manual_seed(step))
        on.backward(on(x))
        on.step()
    return hasattr(off, "gnmr"), on.gnmr.registry.names, on.gnmr.controller.step_count


def test_disabled_block_is_plain_deepspeed_and_any_linear_model_works():
    has_gnmr, names, steps = multiproc.run(_plain_worker, 1)[0]
    assert has_gnmr is False
    assert names == ("layers.0.0", "layers.1.0", "layers.2.0") and steps == 3


def test_gamma_turns_the_backends_error_sums_on_only_when_set():
    from gnmr_dist.backends import PrecisionBackend, get_backend
    from gnmr_dist.integrations.session import error_source

    backend = get_backend("int8")
    backend.wrap({0: nn.Linear(4, 4)})
    assert error_source(GNMRBlock.from_dict({"backend": "int8"}), backend, 2) is None
    with pytest.raises(RuntimeError, match="track_errors"):
        backend.error_sums(torch.device("cpu"))  # gamma unset: nothing is measured
    fn = error_source(GNMRBlock.from_dict({"backend": "int8", "gamma": 1.0}), backend, 2)
    assert torch.equal(fn(torch.device("cpu")), torch.zeros(2, dtype=torch.float64))

    class Silent(PrecisionBackend):  # reports nothing
        name = "silent"

    with pytest.raises(ValueError, match=r"gnmr\.backend=null \(observe only\)"):
        GNMRBlock.from_dict({"backend": None, "gamma": 1.0})  # refused where it is read
    by_hand = GNMRBlock(backend="silent", policy=GNMRConfig(gamma=1.0))  # no from_dict check
    with pytest.raises(ValueError, match=r"gnmr\.backend='silent' reports no per-unit error"):
        error_source(by_hand, Silent(), 2)
    assert Silent().error_sums(torch.device("cpu")) is None
