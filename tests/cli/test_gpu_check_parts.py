"""The parts of ``gnmr-gpu-check`` that need no GPU: the host check, and the oracles and readers
the GPU checks compare with.

* ``shadow_casts[cpu]`` passes here, and fails when the shadow's FP8 cast stops rounding to
  nearest (a cast that scales by 0.97 before rounding);
* :func:`~gnmr_dist.train.gpu_check.te_model.te_update`, delayed scaling's update as read from
  ``common/recipe/delayed_scaling.cu``, on a hand-worked history;
* :func:`~gnmr_dist.train.gpu_check.te_quant.te_cast` reads TE's quantized tensors back: fed
  tensors laid out as TE's source stores them (``_data`` and its ``_transpose``, columnwise data
  transposed for 1 x 128 and NVFP4 and not for MXFP8, scales padded for the GEMM, FP4 packed two
  a byte, low nibble first), built by hand from the shadow's own casts, it returns those casts
  and the same ``B`` (the layouts are the ones TE 2.20 documents; TE itself is not imported);
* the megatron check's ``"gnmr"`` block is a valid block, and its outlier grows as stated.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from gnmr_dist.backends.numerics import te_casts
from gnmr_dist.backends.shadow import wgrad_bound
from gnmr_dist.integrations.config import GNMRBlock
from gnmr_dist.train.gpu_check.host import check_shadow_casts, fp64_bound
from gnmr_dist.train.gpu_check.mcore_checks import gamma_block, outlier_size
from gnmr_dist.train.gpu_check.operands import (
    BLOCK,
    E2M1_GRID,
    nearest_fp8,
    outlier_operands,
    recipe_of,
    shadow_operands,
)
from gnmr_dist.train.gpu_check.te_model import te_update
from gnmr_dist.train.gpu_check.te_quant import _compare, te_bound, te_cast

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4")


def test_the_host_check_passes_on_this_cpu():
    outcome = check_shadow_casts(None, "cpu")
    assert outcome.ok, outcome.detail
    assert outcome.data["delayed"]["saturated"] > 0 and outcome.data["nvfp4"]["sr_moved"] > 0.05


def test_the_host_check_fails_when_a_cast_stops_rounding_to_nearest(monkeypatch):
    def off(t, fmt):
        return (t * 0.97).clamp(-fmt.max_value, fmt.max_value).to(fmt.dtype)

    monkeypatch.setattr(te_casts, "_fp8", off)
    outcome = check_shadow_casts(None, "cpu")
    assert not outcome.ok and "not the nearest" in outcome.detail


def test_nearest_fp8_rounds_ties_to_even_and_saturated_values_stay():
    v = torch.tensor([1.0625, 1.1875, 448.0, -448.0, 0.0, 2.0**-10, 3 * 2.0**-10])
    want = torch.tensor([1.0, 1.25, 448.0, -448.0, 0.0, 0.0, 2.0**-8])
    assert torch.equal(nearest_fp8(v, torch.float8_e4m3fn), want)
    x = torch.randn(4096) * 50
    assert torch.equal(
        nearest_fp8(x.clamp(-448, 448), torch.float8_e4m3fn),
        x.clamp(-448, 448).to(torch.float8_e4m3fn).float(),
    )


# ------------------------------------------------------------------------------ delayed scaling


def test_te_update_rolls_the_history_and_scales_by_its_max():
    scale = torch.tensor([2.0, 3.0])
    hist = torch.tensor([[0.0, 0.0], [1.0, 9.0], [3.0, 0.0], [2.0, 0.0]])
    new = te_update(
        {"scaling_fwd": (scale, hist)},
        {"scaling_fwd": {0: torch.tensor(5.0), 1: torch.tensor(0.0)}},
    )
    new_scale, new_hist = new["scaling_fwd"]
    # slot 0: row 0 cleared, rows shift up (row 1's 1.0 counts in the max, then drops), new last
    assert new_hist[:, 0].tolist() == [0.0, 3.0, 2.0, 5.0]
    assert new_scale[0] == torch.tensor(448.0) / torch.tensor(5.0)
    # slot 1: a zero amax (a unit that ran BF16) leaves history and scale alone
    assert new_hist[:, 1].tolist() == [0.0, 9.0, 0.0, 0.0] and new_scale[1] == 3.0
    reset = te_update(
        {"scaling_bwd": (torch.ones(1), torch.zeros(4, 1))}, {"scaling_bwd": {0: torch.tensor(0.5)}}
    )
    assert reset["scaling_bwd"][0].item() == 57344.0 / 0.5  # 448/amax's e5m2 twin, from empty


# ------------------------------------------------------------------------------ TE's layouts


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return F.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0]))


def _pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """e2m1 values ``[R, C]`` -> TE's bytes ``[R, C / 2]`` (element ``2i`` in the low nibble)."""
    grid = torch.tensor(E2M1_GRID)
    nibble = torch.searchsorted(grid, values.abs()) | (torch.signbit(values).int() << 3)
    nibble = nibble.to(torch.uint8)
    return nibble[:, 0::2] | (nibble[:, 1::2] << 4)


def _as_te(name: str, cast, t: torch.Tensor) -> SimpleNamespace:
    """The quantized tensor TE would hold for the shadow's ``cast`` of ``t`` (module docstring)."""
    if BLOCK[name] == 0:
        raw = cast.codes.view(torch.uint8)
        return SimpleNamespace(
            _data=raw,
            _transpose=raw.t().contiguous(),
            _transpose_invalid=False,
            _scale_inv=cast.scale_inv.reshape(1),
        )
    if name == "nvfp4":
        scales = cast.scale_inv.t().to(torch.float8_e4m3fn).view(torch.uint8)
        return SimpleNamespace(
            _columnwise_data=_pack_e2m1(cast.codes.t().contiguous()),
            _columnwise_scale_inv=_pad(scales, 384 if t.shape[1] <= 384 else 640, 16),
            _amax_columnwise=t.abs().amax().reshape(1),
        )
    if name == "blockwise":
        data, scales = cast.codes.view(torch.uint8).t().contiguous(), cast.scale_inv
        return SimpleNamespace(
            _columnwise_data=data, _columnwise_scale_inv=_pad(scales, 2, t.shape[1] + 4)
        )
    return SimpleNamespace(
        _columnwise_data=cast.codes.view(torch.uint8),
        _columnwise_scale_inv=_pad(cast.scale_inv, 12, t.shape[1]),
    )


@pytest.mark.parametrize("name", RECIPES)
def test_te_cast_reads_te_s_layouts_back_as_the_shadow_s(name):
    x, dy = outlier_operands("cpu")
    ops = shadow_operands(name, x, dy)
    recipe = recipe_of(name)
    read = {}
    for side, cast, t, fmt in (
        ("x", ops.x_cast, ops.x, recipe.x_format),
        ("dy", ops.dy_cast, ops.dy, recipe.grad_format),
    ):
        read[side] = te_cast(name, fmt, _as_te(name, cast, t), t.shape[0], t.shape[1])
        assert _compare(name, side, read[side], cast, t) == []
        assert torch.equal(read[side].decoded(name), cast.dequantized)
    assert te_bound(name, ops, read["x"], read["dy"]) == float(wgrad_bound(ops))
    assert abs(float(wgrad_bound(ops)) - fp64_bound(ops)) <= 1e-4 * fp64_bound(ops)


def test_a_wrong_byte_or_scale_is_reported():
    x, dy = outlier_operands("cpu")
    ops = shadow_operands("mxfp8", x, dy)
    te = _as_te("mxfp8", ops.x_cast, ops.x)
    te._columnwise_data = te._columnwise_data.clone()
    te._columnwise_data[3, 5] ^= 1
    te._columnwise_scale_inv = te._columnwise_scale_inv.clone()
    te._columnwise_scale_inv[0, 0] += 1
    got = _compare("mxfp8", "x", te_cast("mxfp8", "e4m3", te, 256, 384), ops.x_cast, ops.x)
    assert got == ["x: 1 of 98304 codes differ", "x: 1 scales differ"]


# ------------------------------------------------------------------------------ megatron_gamma


def test_the_megatron_block_is_valid_and_the_outlier_grows_4x_to_2_to_the_10(tmp_path):
    block = GNMRBlock.of(gamma_block(0.25, tmp_path / "t.jsonl"))
    assert block.backend == "te_fp8" and block.error_every == 1 and block.units == "operator"
    assert block.policy.gamma == 0.25 and block.policy.max_active == 1
    assert [outlier_size(s) for s in range(1, 13)] == [
        1,
        1,
        1,
        1,
        4,
        16,
        64,
        256,
        1024,
        1024,
        1024,
        1024,
    ]
