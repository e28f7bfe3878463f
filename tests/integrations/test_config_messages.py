"""What a config error says (issue 41, item 10): a name in the wrong case gets its suggestion, an
option block without keys says so and whose it is, and a resume whose saved GNMR state was saved
under other settings names the setting to restore, in one sentence, and nothing else."""

from __future__ import annotations

import pytest
import torch

from gnmr_dist import GNMRConfig
from gnmr_dist.backends import get_backend
from gnmr_dist.distributed import GNMRRuntime, UnitRegistry
from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.integrations.state_file import read_state, restore_or_refuse, write_atomic
from gnmr_dist.state import STATE_VERSION, open_state, seal
from tests.backends.external import RoundedBackend  # registers test_rounded
from tests.distributed.toy import Toy


@pytest.mark.parametrize(
    "block, said",
    [
        ({"backend": "ACT_QUANT"}, "gnmr.backend: unknown backend 'ACT_QUANT'; did you mean "),
        ({"backend": "Int8"}, "gnmr.backend: unknown backend 'Int8'; did you mean "),
        ({"units": "Operator"}, "gnmr.units must be one of ['operator', 'layer'], got "),
        (
            {"on_corrupt_state": "FRESH"},
            "gnmr.on_corrupt_state must be one of ['error', 'fresh'], ",
        ),
    ],
)
def test_a_name_in_the_wrong_case_gets_its_suggestion(block, said):
    ((_, value),) = block.items()
    with pytest.raises(ValueError) as err:
        GNMRBlock.from_dict(block)
    message = str(err.value)
    assert message.startswith(said)
    assert f"; did you mean {value.lower()!r}?" in message


def test_an_unknown_option_key_names_the_backend_and_its_keys_or_that_it_takes_none():
    assert RoundedBackend.Recovery is not None  # a dataclass without fields: no recovery keys
    with pytest.raises(ValueError) as err:
        get_backend("test_rounded", recovery={"format": "bf16"})
    assert str(err.value) == (
        "unknown key gnmr.recovery.format: the test_rounded backend's gnmr.recovery takes no "
        "keys; remove gnmr.recovery.format (leave gnmr.recovery empty or out)"
    )

    class NoOptions(RoundedBackend):  # no option dataclasses at all
        name, LowCost, Recovery = "no_options", None, None

    with pytest.raises(ValueError) as err:
        NoOptions(recovery={"format": "bf16"})
    assert str(err.value) == (
        "gnmr.recovery: the no_options backend takes no recovery options, got {'format': "
        "'bf16'}; leave gnmr.recovery empty or out"
    )
    with pytest.raises(ValueError) as err:
        get_backend("int8", recovery={"dtyp": "bf16"})
    assert str(err.value) == (
        "unknown key gnmr.recovery.dtyp; did you mean 'dtype'? (valid keys of the int8 "
        "backend's gnmr.recovery: dtype)"
    )
    with pytest.raises(ValueError) as err:
        GNMRBlock.from_dict({"backend": "act_quant", "low_cost": {"bitz": 4}}).build_backend()
    assert str(err.value) == (
        "unknown key gnmr.low_cost.bitz; did you mean 'bits'? (valid keys of the act_quant "
        "backend's gnmr.low_cost: bits, group_size)"
    )


def _runtime(layers: int = 2, window: int = 8) -> GNMRRuntime:
    model = Toy(layers=layers)
    runtime = GNMRRuntime(UnitRegistry.from_model(model), GNMRConfig(window=window))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    runtime.step()
    return runtime


def _refusal(tmp_path, saved: GNMRRuntime, resumed: GNMRRuntime, block=None) -> str:
    path = tmp_path / "gnmr_state.pt"
    write_atomic(saved.state_dict(), path)
    with pytest.raises(ValueError) as err:
        restore_or_refuse(GNMRBlock.of(block or {}), "global_step1", read_state(path), resumed)
    return str(err.value)


MISMATCH = "gnmr: the GNMR state of global_step1 is intact but was saved under other settings: "


def test_a_settings_mismatch_names_the_setting_to_restore_and_nothing_else(tmp_path):
    small, large = _runtime(layers=1), _runtime(layers=2)
    said = _refusal(tmp_path, small, large)
    names = sorted(set(large.registry.names) - set(small.registry.names))
    assert said == (
        f"{MISMATCH}GNMR state was saved for {small.registry.num_units} units, this model has "
        f"{large.registry.num_units}; first differing names: {names[:5]}; the unit list must "
        "match: resume with the model, gnmr.units and gnmr.include/exclude it was saved with."
    )
    said = _refusal(tmp_path, _runtime(window=8), _runtime(window=4))
    assert said == (
        f"{MISMATCH}GNMR state was saved with window=8, the config has window=4; the window "
        "length cannot change on resume: set gnmr.window back to 8."
    )
    body = open_state(_runtime().state_dict(), "runtime")  # a state from a later release
    controller = open_state(body["controller"], "controller")
    body["controller"] = seal({**controller, "version": STATE_VERSION + 1})
    path = tmp_path / "future.pt"
    write_atomic(seal(body), path)
    with pytest.raises(ValueError) as err:
        restore_or_refuse(GNMRBlock.of({}), "global_step1", read_state(path), _runtime())
    assert str(err.value).endswith(
        f"GNMR state has format version {STATE_VERSION + 1}; this gnmr-dist reads versions 1 "
        f"and {STATE_VERSION}: resume with the gnmr-dist release that wrote it."
    )
    for text in (said, str(err.value)):
        assert ".." not in text and "on_corrupt_state" not in text and "fresh" not in text


def test_a_corrupted_state_still_offers_a_fresh_start(tmp_path):
    path = tmp_path / "gnmr_state.pt"
    path.write_bytes(b"")
    with pytest.raises(ValueError) as err:
        restore_or_refuse(GNMRBlock.of({}), "global_step3", read_state(path), _runtime())
    assert str(err.value) == (
        f"gnmr: cannot restore the GNMR state of global_step3: {path} is empty (0 bytes), not a "
        "GNMR state. Restore the checkpoint from a good copy or resume from an earlier one; to "
        'start the controller fresh on purpose set "on_corrupt_state": "fresh" in the gnmr '
        "block."
    )
