"""Transformer Engine's casts (``numerics/te_casts.py``) against brute force and torchao.

The brute-force references loop over tiles in Python, do TE's fp32 arithmetic on
``numpy.float32`` scalars as TE's sources write it (``recipe_common.cuh``, ``ptx_arch_spec.cuh``,
``reference_nvfp4.py``) and round with the code-table search of ``test_numerics`` (nothing of
``gnmr_dist/backends/numerics``). torchao 0.18 is the third-party reference: its float8 casts
(per tensor; rowwise with power-of-two scales), its MXFP8 with ``RCEIL`` scales, and its NVFP4,
on tensors with outlier channels.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from gnmr_dist.backends.numerics import te_casts as tc
from tests.backends.test_numerics import assert_bit_equal, reference_round

F32 = np.float32
FP32_MAX = float(np.finfo(np.float32).max)


def outliers(rows: int, cols: int, seed: int, dtype=torch.bfloat16, tiny=True) -> torch.Tensor:
    """Gaussian activations with three hot channels (x60, x400, x0.01) and a tiny row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[:, 3] *= 60
    x[:, cols // 2] *= 400
    x[:, -1] *= 0.01
    if tiny:
        x[1] *= 1e-3
    return x.to(dtype)


def ref_round(value, name: str) -> np.float32:
    return F32(reference_round(torch.tensor([float(value)], dtype=torch.float32), name).item())


def ref_scale(amax, max_value, pow2=False, eps=0.0, value_for_inf=FP32_MAX) -> np.float32:
    """``compute_scale_from_amax`` line by line, on Python scalars rounded to fp32."""
    a = F32(amax)
    if a < F32(eps):
        a = F32(eps)
    if math.isinf(a) or a == 0 or math.isnan(a):
        return F32(1.0)
    with np.errstate(over="ignore"):
        scale = F32(F32(max_value) / a)
    if math.isinf(scale):
        scale = F32(value_for_inf)
    if pow2:
        bits = struct.unpack("<I", struct.pack("<f", scale))[0] & 0xFF800000
        scale = F32(struct.unpack("<f", struct.pack("<I", bits))[0])
    return scale


def ref_fp8(x: torch.Tensor, name: str, scales: np.ndarray, tile: tuple[int, int]) -> np.ndarray:
    """``fp8(x * scale) * fl(1 / scale)`` with each tile's scale (numpy's fp32 products, the
    code-table rounding of the whole array at once)."""
    a = x.float().numpy()
    s = np.repeat(np.repeat(scales, tile[0], axis=0), tile[1], axis=1)[: a.shape[0], : a.shape[1]]
    q = reference_round(torch.from_numpy(a * s).reshape(-1), name).numpy().reshape(a.shape)
    return (q * (F32(1.0) / s)).astype(np.float32)


@pytest.mark.parametrize(
    ("amax", "pow2", "eps"),
    [(3.0, False, 0.0), (3.0, True, 0.0), (0.0, False, 0.0), (math.inf, True, 0.0),
     (math.nan, False, 0.0), (1e-44, False, 0.0), (1e-44, True, 0.0), (1e-9, False, 1e-3),
     (448.0, True, 0.0), (0.7, True, 0.0)],
)  # fmt: skip
def test_scale_from_amax_is_tes_line_by_line(amax, pow2, eps):
    got = tc.scale_from_amax(torch.tensor(amax), 448.0, pow2=pow2, eps=eps)
    assert got.item() == ref_scale(amax, 448.0, pow2, eps) or (math.isnan(got) and math.isnan(amax))


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_per_tensor_cast_is_brute_force(name):
    x = outliers(24, 40, seed=1)
    max_value = 448.0 if name == "e4m3" else 57344.0
    scale = tc.scale_from_amax(x.float().abs().amax(), max_value)
    got = tc.cast_tensor(x, name, scale)
    want = ref_fp8(x, name, np.array([[F32(scale.item())]]), x.shape)
    assert_bit_equal(got.dequantized, torch.from_numpy(want))
    assert got.codes.dtype == getattr(torch, f"float8_{name}{'fn' if name == 'e4m3' else ''}")


@pytest.mark.parametrize(("tile", "pow2"), [((1, 128), True), ((128, 128), True), ((1, 16), False)])
def test_block_cast_is_brute_force_with_ragged_tiles(tile, pow2):
    x = outliers(130, 300, seed=2)  # neither dim a multiple of 128: TE zero-pads the last tiles
    got = tc.cast_blocks(x, "e4m3", tile, pow2=pow2)
    a = x.float().numpy()
    rows, cols = -(-a.shape[0] // tile[0]), -(-a.shape[1] // tile[1])
    scales = np.empty((rows, cols), dtype=np.float32)
    bf16_max = float(torch.finfo(torch.bfloat16).max)  # value_for_inf: the input dtype's max
    for r in range(rows):
        for c in range(cols):
            block = a[r * tile[0] : (r + 1) * tile[0], c * tile[1] : (c + 1) * tile[1]]
            scales[r, c] = ref_scale(np.abs(block).max(), 448.0, pow2, 0.0, bf16_max)
    assert_bit_equal(got.dequantized, torch.from_numpy(ref_fp8(x, "e4m3", scales, tile)))
    assert_bit_equal(got.scale_inv, torch.from_numpy(F32(1.0) / scales))


def test_e8m0_rounds_up_as_tes_bit_rule():
    tiny = np.float32(2.0**-127)  # subnormal: biased exponent 0
    values = [0.0, 1.0, 1.0000001, 0.99999994, 2.0**-126, 2.0**-127, 2.0**-127 * 1.5,
              2.0**-149, 3.0e38, FP32_MAX, math.inf, math.nan, 448.0, 449.0,
              float(tiny) * 1.0000001]  # fmt: skip
    got = tc.e8m0_round_up(torch.tensor(values, dtype=torch.float32))
    for v, e in zip(values, got.tolist(), strict=True):
        if math.isnan(v):
            assert e == 255
            continue
        if math.isinf(v):
            assert e == 254
            continue
        bits = struct.unpack("<I", struct.pack("<f", F32(v)))[0]
        exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        if (
            v != 0
            and mantissa > 0
            and exponent != 0xFE
            and not (exponent == 0 and mantissa <= 0x400000)
        ):
            exponent += 1
        assert e == exponent, v


def test_mxfp8_is_brute_force():
    x = outliers(8, 96, seed=3)
    got = tc.cast_mxfp8(x, "e4m3")
    a = x.float().numpy()
    want = np.empty_like(a)
    for r in range(a.shape[0]):
        for c in range(0, a.shape[1], 32):
            v = F32(F32(np.abs(a[r, c : c + 32]).max()) * F32(1.0 / 448.0))
            e = int(tc.e8m0_round_up(torch.tensor([float(v)])).item())
            assert got.scale_inv[r, c // 32].item() == e
            for j in range(32):
                q = ref_round(F32(a[r, c + j]) * F32(2.0 ** (127 - e)), "e4m3")
                want[r, c + j] = F32(q * F32(2.0 ** (e - 127)))
    assert_bit_equal(got.dequantized, torch.from_numpy(want))


def ref_nvfp4(x: torch.Tensor, rows: slice = slice(None)) -> np.ndarray:
    """TE's ``_quantize_blockwise_reference`` (1 x 16) and ``dequantize_nvfp4.cuh``, per
    element on fp32 scalars, for ``rows`` of ``x`` (the tensor amax of the whole)."""
    amax = F32(np.abs(x.float().numpy()).max())
    a = x.float().numpy()[rows]
    s_enc = min(F32(F32(448.0 * 6.0) / amax) if amax > 0 else F32(math.inf), F32(FP32_MAX))
    s_enc = F32(1.0) if s_enc == 0 else s_enc
    s_dec = F32(F32(1.0) / s_enc)
    mult = F32(s_enc * F32(1.0 / 6.0))
    out = np.empty_like(a)
    for r in range(a.shape[0]):
        for c in range(0, a.shape[1], 16):
            block = a[r, c : c + 16]
            sc = min(F32(F32(np.abs(block).max()) * mult), F32(FP32_MAX))
            sc = ref_round(min(max(sc, F32(-448)), F32(448)), "e4m3")
            enc = min(F32(F32(1.0) / F32(sc * s_dec)) if sc > 0 else F32(math.inf), F32(FP32_MAX))
            factor = F32(F32(sc * amax) * F32(1.0 / 2688.0))
            for j, v in enumerate(block):
                q = ref_round(min(max(F32(F32(v) * enc), F32(-6)), F32(6)), "e2m1")
                out[r, c + j] = F32(q * factor)
    return out


def test_nvfp4_is_tes_reference_arithmetic():
    x = outliers(12, 64, seed=4)
    assert_bit_equal(tc.cast_nvfp4(x).dequantized, torch.from_numpy(ref_nvfp4(x)))


def test_rht_is_tes_signed_sylvester_transform_and_orthonormal():
    x = outliers(5, 48, seed=5, dtype=torch.float32)
    h = torch.tensor([[1.0]])
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.tensor(tc.RHT_SIGNS, dtype=torch.float32)
    want = x.reshape(-1, 16).double() @ (torch.diag(signs) @ h).double() / 4
    got = tc.te_rht(x)
    assert torch.allclose(got.double(), want.reshape(x.shape), rtol=1e-6, atol=1e-5)
    assert torch.allclose(got.double().norm(), x.double().norm(), rtol=1e-6)
    assert tc.te_rht(x.bfloat16()).dtype == torch.bfloat16  # rounded back, as TE's kernel
    with pytest.raises(ValueError, match="multiple of 16"):
        tc.te_rht(torch.ones(2, 20))


# ------------------------------------------------------------------ torchao, the third party


@pytest.fixture(scope="module")
def torchao():
    pytest.importorskip("torchao")
    import torchao.float8.float8_training_tensor as f8t
    import torchao.float8.float8_utils as f8u
    import torchao.prototype.mx_formats.kernels as mxk
    import torchao.prototype.mx_formats.mx_tensor as mx
    import torchao.prototype.mx_formats.nvfp4_tensor as nv

    return f8t, f8u, mx, nv, mxk


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_per_tensor_and_rowwise_casts_equal_torchaos(torchao, dtype, seed):
    f8t, f8u, *_ = torchao
    x = outliers(64, 256, seed=seed)
    name = "e4m3" if dtype == torch.float8_e4m3fn else "e5m2"
    scale = f8u.amax_to_scale(x.float().abs().amax(), dtype)
    ours = tc.scale_from_amax(x.float().abs().amax(), torch.finfo(dtype).max)
    assert ours.view(torch.int32) == scale.view(torch.int32)  # fp64 division, rounded: the same
    theirs = f8t.hp_tensor_and_scale_to_float8(x, scale, dtype)
    assert torch.equal(
        theirs._data.view(torch.uint8), tc.cast_tensor(x, name, ours).codes.view(torch.uint8)
    )
    # rowwise: one scale per row along the reduction dim, rounded down to a power of two
    row_amax = x.float().abs().amax(dim=1, keepdim=True)
    row_scale = f8u.amax_to_scale(row_amax, dtype, round_scales_to_power_of_2=True)
    rows = f8t.hp_tensor_and_scale_to_float8(x, row_scale, dtype, axiswise_dim=-1)
    ours_rows = tc.cast_blocks(x, name, (1, x.shape[1]), pow2=True)
    assert torch.equal(ours_rows.scale_inv.view(-1), 1 / row_scale.view(-1))
    assert torch.equal(rows._data.view(torch.uint8), ours_rows.codes.view(torch.uint8))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mxfp8_equals_torchaos_rceil(torchao, seed):
    *_, mx, _, _ = torchao
    x = outliers(64, 256, seed=seed)
    scales, data = mx.to_mx(x.contiguous(), torch.float8_e4m3fn, 32, mx.ScaleCalculationMode.RCEIL)
    ours = tc.cast_mxfp8(x, "e4m3")
    assert torch.equal(scales.view(torch.uint8).reshape(ours.scale_inv.shape), ours.scale_inv)
    assert torch.equal(data.view(torch.uint8).reshape(x.shape), ours.codes.view(torch.uint8))


def test_mxfp8_where_torchao_eager_rounds_the_log_and_te_does_not(torchao):
    *_, mx, _, _ = torchao
    x = torch.zeros(1, 32)
    x[0, 0] = 448.0 * 2.0**-10 * (1 + 2.0**-23)  # amax / 448 one ulp above a power of two
    ours = tc.cast_mxfp8(x, "e4m3")
    theirs, _ = mx.to_mx(x, torch.float8_e4m3fn, 32, mx.ScaleCalculationMode.RCEIL)
    v = F32(F32(x[0, 0].item()) * F32(1.0 / 448.0))
    assert v > F32(2.0**-10) and ours.scale_inv.item() == 127 - 10 + 1  # TE rounds up
    assert int(theirs.view(torch.uint8).item()) in (127 - 10, 127 - 10 + 1)  # log2 in fp32


@pytest.mark.parametrize("seed", [0, 3])
def test_nvfp4_matches_torchao_except_where_its_scale_arithmetic_rounds_apart(torchao, seed):
    """torchao computes a block scale as ``(amax_b / 6) / (A / 2688)`` and the encode factor as
    ``(1 / pts) / sc``, TE as ``amax_b * (2688 / A * fl(1/6))`` and ``1 / (sc * fl(1/S_enc))``:
    one rounding apart each. So the E4M3 scales agree on most blocks and differ by one code on
    the others, the e2m1 codes agree but where a value sits on a rounding tie, and ours is TE's
    brute force everywhere.
    (torchao also clamps a block scale below at E4M3's smallest normal, where TE rounds it to a
    subnormal: a tiny row, checked last.)"""
    *_, nv, mxk = torchao
    x = outliers(64, 256, seed=seed, tiny=False)
    ours = tc.cast_nvfp4(x)
    scales, packed = nv.nvfp4_quantize(
        x.contiguous(), 16, nv.per_tensor_amax_to_scale(x.float().abs().amax())
    )
    theirs = mxk.f4_unpacked_to_f32(mxk.unpack_uint4(packed)).reshape(x.shape)
    s_theirs = scales.view(torch.uint8).reshape(ours.scale_inv.shape).int()
    s_ours = ours.scale_inv.to(torch.float8_e4m3fn).view(torch.uint8).int()
    same = s_theirs == s_ours
    assert same.float().mean() > 0.95 and (s_theirs - s_ours).abs().max() <= 1
    blocks_same = same.repeat_interleave(16, dim=1)
    agree = theirs[blocks_same] == ours.codes[blocks_same]
    assert agree.float().mean() > 0.995  # the rest: ties the two encode factors split
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    a, b = (t[blocks_same][~agree] for t in (theirs, ours.codes))
    index = [(t.abs()[:, None] == grid[None, :]).int().argmax(dim=1) for t in (a, b)]
    assert ((index[0] - index[1]).abs() <= 1).all()  # neighbouring codes
    assert_bit_equal(ours.dequantized[:6], torch.from_numpy(ref_nvfp4(x, slice(0, 6))))
    x[1] *= 1e-3
    ours = tc.cast_nvfp4(x)
    scales, _ = nv.nvfp4_quantize(
        x.contiguous(), 16, nv.per_tensor_amax_to_scale(x.float().abs().amax())
    )
    small = scales.view(torch.uint8).reshape(ours.scale_inv.shape)[1].int()
    below = ours.scale_inv[1] < 2.0**-6  # TE: subnormal E4M3 scales
    assert below.sum() >= 10 and (small[below] == 8).all()  # torchao: E4M3_EPS = 2^-6
    assert_bit_equal(ours.dequantized[:3], torch.from_numpy(ref_nvfp4(x, slice(0, 3))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_columnwise_casts_are_the_transposed_layouts_bit_for_bit(dtype):
    """The shadow route quantizes TE's columnwise layout in place ([tokens, K], blocks along
    the tokens); it must be TE's transposed data exactly."""
    x = outliers(96, 48, seed=6, dtype=dtype)
    xt = x.t().contiguous()
    pairs = [
        (tc.cast_mxfp8(x, "e4m3", columnwise=True), tc.cast_mxfp8(xt, "e4m3")),
        (tc.cast_nvfp4(x, columnwise=True), tc.cast_nvfp4(xt)),
        (tc.cast_blocks(x, "e5m2", (128, 1)), tc.cast_blocks(xt, "e5m2", (1, 128))),
    ]
    for col, row in pairs:
        assert_bit_equal(col.dequantized, row.dequantized.t().contiguous())
        assert torch.equal(col.scale_inv, row.scale_inv.t())
    rotated = tc.te_rht(x, columnwise=True)
    assert torch.equal(rotated, tc.te_rht(xt).t())
