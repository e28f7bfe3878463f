"""What a bad GNMR state file is called (issue 33, item 6): an empty or foreign file is "not a
GNMR state", and an intact state saved under other settings is not called corruption."""

from __future__ import annotations

import pytest
import torch

from gnmr_dist import GNMRConfig
from gnmr_dist.distributed import GNMRRuntime, UnitRegistry
from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.integrations.state_file import read_state, restore_or_refuse, write_atomic
from tests.distributed.toy import Toy


def _runtime(window: int) -> GNMRRuntime:
    model = Toy()
    runtime = GNMRRuntime(UnitRegistry.from_model(model), GNMRConfig(window=window))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    runtime.step()
    return runtime


def test_an_empty_or_foreign_file_is_named_not_a_gnmr_state(tmp_path):
    empty, text = tmp_path / "empty.pt", tmp_path / "text.pt"
    empty.write_bytes(b"")
    text.write_text("step 3\n")
    assert read_state(empty) == ("corrupted", f"{empty} is empty (0 bytes), not a GNMR state")
    kind, reason = read_state(text)
    assert kind == "corrupted"
    assert reason == (
        f"{text} is not a GNMR state: torch.save did not write it (it starts with b'step 3\\n')"
    )
    block = GNMRBlock.of({})
    with pytest.raises(ValueError, match=r"empty.pt is empty \(0 bytes\), not a GNMR state"):
        restore_or_refuse(block, "global_step3", read_state(empty), _runtime(8))


def test_another_window_is_a_settings_mismatch_not_corruption(tmp_path):
    path = tmp_path / "gnmr_state.pt"
    write_atomic(_runtime(8).state_dict(), path)
    with pytest.raises(ValueError) as err:
        restore_or_refuse(GNMRBlock.of({}), "global_step1", read_state(path), _runtime(4))
    message = str(err.value)
    assert message.startswith("gnmr: the GNMR state of global_step1 is intact but was saved")
    assert "window=8, the config has window=4" in message and "good copy" not in message
    assert restore_or_refuse(GNMRBlock.of({}), "global_step1", read_state(path), _runtime(8))
