"""The parallel settings Megatron users run, built on CPU for tests, on 3 megatron-core releases.

A ``Setting`` names one layout and precision recipe (TP, PP, virtual PP, DP, bf16, where the
gradients are reduced, the distributed optimizer, sequence parallelism). ``build(setting, full)``
builds this rank's model chunks as Megatron-LM's ``get_model``/``setup_model_and_optimizer`` do
(one ``GPTModel`` per virtual stage built with ``vp_stage=``, ``Float16Module`` for bf16,
megatron's ``DistributedDataParallel`` per chunk with bucketing off after the first,
``get_megatron_optimizer``) with the full (TP1, PP1, fp32) model's weights copied in. One
difference: 0.19's Megatron-LM precomputes the distributed optimizer's parameter layout
(``DistributedOptimizer.compute_full_param_layout``) and passes it to DDP; here DDP computes the
same layout itself (and logs a warning saying so). ``train_step`` runs megatron's own schedule with
``finalize_model_grads``; the caller then calls ``optimizer.step()``, which returns megatron's
own grad norm. ``reference`` replays the same steps on the full model in float64 (same
micro-batches, the DP ranks' batches averaged as megatron's DDP averages them, the same clipping
and AdamW), so a test can compare losses, global and per-unit gradient norms with numbers that
owe nothing to megatron's parallel code.

Versions: ``MEGATRON_VERSIONS`` and where each is installed are in ``releases.py`` (its names
are re-exported here, where the tests read them).
"""

from __future__ import annotations

import contextlib
import math
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tests import multiproc
from tests.integrations.megatron import gpt
from tests.integrations.megatron.releases import (  # noqa: F401 (re-exported: the tests read them here)
    MEGATRON_VERSIONS,
    TRAINING_VERSION,
    launch_checks,
    megatron_path,
    megatron_version,
    training_env,
    version_sys_path,
)

LR, CLIP_GRAD, ADAM_EPS = 1e-3, 1.0, 1e-8
PRELOAD = (
    "megatron.core.distributed",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron_patches",
)
"""What the tests that apply GNMR through ``megatron_patches`` have ``multiproc.run_jobs``
import once, before it forks every rank from that process (megatron's import is ~9 s each)."""


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Setting:
    """One parallel layout and precision recipe for the tiny GPT."""

    name: str
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (``virtual_pipeline_model_parallel_size``), or None."""
    dp: int = 1
    """Data-parallel size."""
    bf16: bool = False
    """bf16 params and compute (``Float16Module``, ``Float16OptimizerWithFloat16Params``)."""
    grad_reduce_in_fp32: bool = True
    """DDP grad buffers in fp32 (False with bf16: the buffers and the all-reduce are bf16)."""
    distributed_optimizer: bool = False
    """``use_distributed_optimizer`` in both the DDP and the optimizer config."""
    sequence_parallel: bool = False
    """Sequence parallelism (needs tp > 1)."""

    def __post_init__(self) -> None:
        layers, stages = gpt.MODEL["num_layers"], self.pp * (self.vpp or 1)
        if layers % stages:
            raise ValueError(f"{self.name}: pp x vpp ({stages}) must divide num_layers ({layers})")
        if self.vpp is not None and self.pp < 2:
            raise ValueError(f"{self.name}: vpp ({self.vpp}) needs pp > 1 (pp={self.pp})")
        if self.sequence_parallel and self.tp < 2:
            raise ValueError(f"{self.name}: sequence_parallel needs tp > 1 (tp={self.tp})")
        if not self.grad_reduce_in_fp32 and not self.bf16:
            raise ValueError(
                f"{self.name}: grad_reduce_in_fp32=False only means something with bf16"
            )

    @property
    def world(self) -> int:
        """Processes this setting needs: tp x pp x dp."""
        return self.tp * self.pp * self.dp


SETTINGS = (
    Setting("fp32-dp2", dp=2),
    Setting("bf16-dp2", dp=2, bf16=True, grad_reduce_in_fp32=False),
    Setting("bf16-fp32grads-dp2", dp=2, bf16=True),
    Setting("distopt-fp32-dp2", dp=2, distributed_optimizer=True),
    Setting("distopt-bf16-dp2", dp=2, bf16=True, distributed_optimizer=True),
    Setting("tp2-sp", tp=2, sequence_parallel=True),
    Setting("pp2-vpp2", pp=2, vpp=2),
    Setting(
        "tp2-dp2-distopt-bf16",
        tp=2,
        dp=2,
        bf16=True,
        grad_reduce_in_fp32=False,
        distributed_optimizer=True,
    ),
)
"""The settings Megatron users run: fp32 DP; bf16 with bf16 and with fp32 grad buffers; the
distributed optimizer in fp32 and bf16; TP2 + sequence parallel; PP2 with 2 virtual stages per
rank (interleaved schedule); TP2 x DP2 distributed optimizer bf16 (the one 4-rank setting)."""

SETTINGS_BY_NAME = {s.name: s for s in SETTINGS}


# --------------------------------------------------------------------------- build


@contextlib.contextmanager
def full_layout() -> Iterator[None]:
    """Megatron's parallel state at TP1 x PP1, for the full model (collective: every rank).

    Nested uses, and ``full_model`` / ``reference_grads`` / ``reference`` inside one, share the
    layout (each ``initialize_model_parallel`` builds a dozen gloo groups, ~0.3 s).
    """
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        if ps.get_tensor_model_parallel_world_size() != 1 or (
            ps.get_pipeline_model_parallel_world_size() != 1
        ):
            raise RuntimeError("full_layout: another parallel layout is initialised")
        yield
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    try:
        yield
    finally:
        ps.destroy_model_parallel()


def full_model():
    """The full (TP1, PP1, fp32) model, seed ``gpt.SEED``: the weights every setting starts from.

    Built under ``full_layout()`` (collective: every rank calls it).
    """
    from megatron.core import tensor_parallel

    with full_layout():
        tensor_parallel.model_parallel_cuda_manual_seed(gpt.SEED)
        return gpt.build_gpt(1, 1)


def optimizer_config(setting: Setting):
    """Megatron's ``OptimizerConfig`` for ``setting``: AdamW, no weight decay, clip at 1."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=LR,
        weight_decay=0.0,
        adam_eps=ADAM_EPS,
        clip_grad=CLIP_GRAD,
        bf16=setting.bf16,
        params_dtype=torch.bfloat16 if setting.bf16 else torch.float32,
        use_distributed_optimizer=setting.distributed_optimizer,
    )


def build(setting: Setting, full, optimizer=None):
    """``(model chunks, optimizer)`` of this rank for ``setting``, holding ``full``'s weights.

    ``optimizer``: megatron's ``OptimizerConfig`` to build the optimizer with (default:
    ``optimizer_config(setting)``). Initialises megatron's parallel state for the layout
    (destroy it with ``parallel_state.destroy_model_parallel()``). The chunks are megatron's
    ``DistributedDataParallel`` modules (around ``Float16Module`` for bf16), one per virtual
    pipeline stage.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    if dist.get_world_size() != setting.world:
        raise ValueError(
            f"{setting.name} needs {setting.world} ranks, have {dist.get_world_size()}"
        )
    ps.initialize_model_parallel(
        tensor_model_parallel_size=setting.tp,
        pipeline_model_parallel_size=setting.pp,
        virtual_pipeline_model_parallel_size=setting.vpp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(gpt.SEED)
    dtype = torch.bfloat16 if setting.bf16 else torch.float32
    config = gpt.gpt_config(
        setting.tp,
        setting.pp,
        virtual_pipeline_model_parallel_size=setting.vpp,
        sequence_parallel=setting.sequence_parallel,
        bf16=setting.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=setting.grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=setting.distributed_optimizer,
    )
    chunks = []
    for index, vp_stage in enumerate(range(setting.vpp) if setting.vpp else [None]):
        model = gpt.build_gpt(setting.tp, setting.pp, config=config, vp_stage=vp_stage)
        gpt.copy_full_weights(model, full, ps.get_tensor_model_parallel_rank(), setting.tp)
        if setting.bf16:
            model = Float16Module(config, model)
        chunks.append(
            DistributedDataParallel(
                config=config, ddp_config=ddp_config, module=model, disable_bucketing=index > 0
            )
        )
    no_sync = [c.no_sync for c in chunks]
    config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
    config.finalize_model_grads_func = finalize_model_grads
    opt_config = optimizer if optimizer is not None else optimizer_config(setting)
    return chunks, get_megatron_optimizer(opt_config, chunks)


def patched(setting: Setting, block: dict):
    """``(chunks, optimizer, handle)``: the full model built under ``setting`` on this rank,
    megatron's CPU compatibility on, and ``megatron_patches.enable`` with the GNMR ``block``
    (what most GNMR workers start with; warnings silenced)."""
    import warnings

    import megatron_patches
    from gnmr_dist.testing.megatron_cpu import enable_cpu_compat

    warnings.filterwarnings("ignore")
    enable_cpu_compat()
    with full_layout():
        full = full_model()
    chunks, opt = build(setting, full)
    return chunks, opt, megatron_patches.enable(chunks, block, optimizer=opt)


def train_step(chunks, step: int = 0) -> float:
    """Forward/backward of ``gpt.NUM_MICRO`` micro-batches with megatron's schedule.

    Returns the step's loss (mean over micro-batches and DP ranks) on every rank. Gradients are
    final (``finalize_model_grads`` ran) when it returns; call ``optimizer.step()`` next.

    Starts as Megatron-LM's ``train_step`` does: ``zero_grad_buffer()`` on every chunk and the
    model parameters' ``.grad`` cleared (``optimizer.zero_grad()``). The second matters: after
    ``optimizer.step()`` a fp32 parameter's ``.grad`` *is* its ``main_grad``, so the next backward
    would accumulate into the buffer through ``.grad`` and again through DDP's hook.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in chunks:
        chunk.zero_grad_buffer()
        for param in chunk.parameters():
            param.grad = None
    dp_rank = ps.get_data_parallel_rank()
    batches = [gpt.micro_batch(dp_rank, m, step) for m in range(gpt.NUM_MICRO)]
    data = [iter(batches) for _ in chunks]  # the interleaved schedule takes one per chunk
    losses = get_forward_backward_func()(
        forward_step_func=gpt.forward_step,
        data_iterator=data if len(chunks) > 1 else data[0],
        model=chunks,
        num_microbatches=gpt.NUM_MICRO,
        seq_length=gpt.SEQ,
        micro_batch_size=gpt.MICRO_BATCH,
        forward_only=False,
    )
    loss = torch.zeros((), dtype=torch.float64)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        loss += torch.stack([x["lm loss"] for x in losses]).double().mean()
    dist.all_reduce(loss, group=ps.get_pipeline_model_parallel_group())
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    return float(loss) / ps.get_data_parallel_world_size()


def _owned_slice(param, buffer) -> torch.Tensor:
    """The part of ``param.main_grad`` whose reduced value this DP rank holds.

    Without the distributed optimizer the buffers are all-reduced: every rank holds all of it.
    With it they are reduce-scattered: each bucket splits into ``dp`` equal contiguous shards
    and rank ``r`` holds shard ``r`` (``shard_buffer``); the rest of the buffer keeps this rank's
    local, unreduced gradients. ``param_index_map`` gives the parameter's [start, end) in the
    buffer, so its owned part is its intersection with the rank's shard of its bucket.
    """
    grad = param.main_grad.view(-1)
    if not buffer.ddp_config.use_distributed_optimizer:
        return grad
    start, end, bucket_id = buffer.param_index_map[param]
    bucket, group = buffer.buckets[bucket_id], buffer.data_parallel_group
    shard = bucket.grad_data.numel() // group.size()
    lo = max(start, bucket.offset + group.rank() * shard)
    hi = min(end, bucket.offset + (group.rank() + 1) * shard)
    return grad[lo - start : max(hi, lo) - start]  # possibly empty


def grad_norms_by_param(chunks) -> dict[str, float]:
    """Per global parameter name, the norm of the reduced gradient in megatron's grad buffers.

    Call after ``train_step`` and before ``optimizer.step()``: clipping scales fp32 buffers in
    place (the optimizers' ``.grad`` is ``main_grad`` itself, or a view or ``.float()`` of it).
    Collective over the world. Each value counts every TP shard once, replicated parameters once
    (TP rank 0) and every DP rank's owned slice once (see ``_owned_slice``).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    from gnmr_dist.distributed.units import global_param_names
    from gnmr_dist.integrations.megatron.operators import MEGATRON_MARKS

    first_dp = ps.get_data_parallel_rank() == 0
    squares: dict[str, float] = {}
    for chunk in chunks:
        names = global_param_names(chunk, marks=MEGATRON_MARKS)
        by_param = {p: n for n, p in chunk.named_parameters()}
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            sharded = buffer.ddp_config.use_distributed_optimizer
            for param in buffer.param_index_map:
                if not param_is_not_tensor_parallel_duplicate(param) or not (sharded or first_dp):
                    continue
                name = names[by_param[param]]
                value = float(_owned_slice(param, buffer).double().square().sum())
                squares[name] = squares.get(name, 0.0) + value
    gathered: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, squares)
    total: dict[str, float] = {}
    for part in gathered:
        for name, value in part.items():
            total[name] = total.get(name, 0.0) + value
    return {name: math.sqrt(value) for name, value in total.items()}


# --------------------------------------------------------------------------- reference


@dataclass(frozen=True)
class Reference:
    """The full model's float64 run: per step, the loss, the grads and their global norm."""

    losses: list[float]
    grads: list[dict[str, torch.Tensor]]
    """Per step: float64 gradient of every parameter, keyed by global parameter name."""
    initial_losses: list[float]
    """Per step: the loss of the *initial* weights on that step's batches (no update applied)."""

    @property
    def grad_norms(self) -> list[float]:
        """Per step: the global L2 norm of the gradients (before clipping)."""
        return [global_norm(g) for g in self.grads]


def global_norm(grads: dict[str, torch.Tensor]) -> float:
    """L2 norm over every gradient in ``grads``."""
    return math.sqrt(sum(float(g.square().sum()) for g in grads.values()))


def _float64_twin(full):
    """A float64 copy of the full model (rebuilt: megatron modules hold process groups, which
    ``copy.deepcopy`` cannot copy). Call under ``full_layout()``."""
    twin = gpt.build_gpt(1, 1)
    gpt.copy_full_weights(twin, full, 0, 1)
    return twin.double()


def _loss(model, dp: int, step: int) -> torch.Tensor:
    """Loss of the float64 full model on step ``step``'s micro-batches, all ``dp`` ranks'.

    Cross entropy on the model's logits in float64 (not megatron's vocab-parallel cross entropy,
    which computes in fp32), averaged over tokens per micro-batch and then over micro-batches:
    what megatron's schedule (divides by the number of micro-batches) and DDP (averages over DP)
    compute.
    """
    batches = [gpt.micro_batch(d, m, step) for d in range(dp) for m in range(gpt.NUM_MICRO)]
    loss = torch.zeros((), dtype=torch.float64)
    for b in batches:
        logits = model(b["tokens"], b["position_ids"], None)  # [b, s, vocab]
        loss = loss + torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).double(), b["labels"].flatten()
        )
    return loss / len(batches)


def _loss_and_grads(model, dp: int, step: int) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = _loss(model, dp, step)
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def reference_grads(full, dp: int, step: int = 0) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and float64 gradient of every parameter of ``full`` (global names) on step ``step``.

    ``full``'s own weights (a float64 copy), the micro-batches ``train_step(chunks, step)`` feeds
    on every DP rank, averaged over all ``dp`` ranks as megatron's DDP averages them. Runs under
    ``full_layout()`` (collective: every rank calls it).
    """
    with full_layout():
        return _loss_and_grads(_float64_twin(full), dp, step)


def reference(full, dp: int, steps: int) -> Reference:
    """``steps`` training steps of a float64 copy of ``full``, as megatron's optimizer runs them.

    Each step: ``reference_grads`` on that step's micro-batches, then megatron's clipping
    (``clip_grad_by_total_norm_fp32``: scale by ``CLIP_GRAD / (norm + 1e-6)`` when below 1) and
    ``torch.optim.AdamW`` with the ``optimizer_config`` hyper-parameters (AdamW is megatron's
    optimizer on a host without TE/apex). Collective, like ``reference_grads``.
    """
    losses, grads, initial = [], [], []
    with full_layout():
        model, frozen = _float64_twin(full), _float64_twin(full)
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, eps=ADAM_EPS)
        for step in range(steps):
            loss, step_grads = _loss_and_grads(model, dp, step)
            losses.append(loss)
            grads.append(step_grads)
            with torch.no_grad():
                initial.append(float(_loss(frozen, dp, step)))
            coeff = CLIP_GRAD / (global_norm(step_grads) + 1.0e-6)
            if coeff < 1.0:
                torch._foreach_mul_([p.grad for p in params], coeff)
            opt.step()
    return Reference(losses, grads, initial)


# --------------------------------------------------------------------------- running the matrix


def matrix_params():
    """``pytest.param(name, version)`` for every setting on every release (marked slow).

    The bf16 settings on the venv's release are also marked ``isa``: their figures come from
    the CPU's bf16 GEMM kernels, so ``make test`` runs them again under another oneDNN ISA (the
    kernels are torch's, not megatron's: one release is enough)."""
    import pytest

    def marks(setting: Setting, version: str) -> list:
        isa = setting.bf16 and version == MEGATRON_VERSIONS[0]
        return [pytest.mark.slow, pytest.mark.isa] if isa else [pytest.mark.slow]

    return [
        pytest.param(s.name, v, id=f"{s.name}-mcore{v}", marks=marks(s, v))
        for v in MEGATRON_VERSIONS
        for s in SETTINGS
    ]


class ReleaseRuns:
    """Every setting run once per release by ``worker(rank, world, names, *args)``, cached.

    One process per release imports megatron (``preload``) and forks every rank of every world
    size from it (``multiproc.run_jobs``). The worker returns ``{setting name: result}`` plus
    metadata keys (at least ``"version"``: the megatron-core it imported); a setting's failure
    may be its result as a traceback string.
    """

    def __init__(self, worker: Callable[..., dict], *args: object, preload: tuple[str, ...]):
        self.worker, self.args, self.preload = worker, args, preload
        self._runs: dict[str, dict] = {}

    def release(self, version: str) -> dict:
        """``{"by_setting": {name: [per-rank result]}, "meta": {key: sorted values}}``."""
        import pytest

        sys_path = version_sys_path(version)  # skips (locally) or fails (CI) if missing
        if version not in self._runs:
            self._runs[version] = self._run(sys_path)
        if "error" in self._runs[version]:
            pytest.fail(
                f"megatron-core {version}: the workers failed\n{self._runs[version]['error']}"
            )
        return self._runs[version]

    def _run(self, sys_path: list[str]) -> dict:
        worlds = sorted({s.world for s in SETTINGS})
        names = [[s.name for s in SETTINGS if s.world == w] for w in worlds]
        jobs = [(self.worker, w, (n, *self.args)) for w, n in zip(worlds, names, strict=True)]
        try:
            runs = multiproc.run_jobs(jobs, sys_path_prepend=sys_path, preload=self.preload)
        except Exception:
            return {"error": traceback.format_exc()}
        results = [r for run in runs for r in run]
        return {
            "by_setting": {
                n: [r[n] for r in run] for run in runs for n in run[0] if n in SETTINGS_BY_NAME
            },
            "meta": {
                k: sorted({r[k] for r in results}) for k in results[0] if k not in SETTINGS_BY_NAME
            },
        }

    def ranks(self, version: str, name: str) -> list:
        """Every rank's result for setting ``name`` on ``version`` (fails on a worker error)."""
        import pytest

        release = self.release(version)
        imported = release["meta"]["version"]
        assert imported == [version], f"workers imported megatron-core {imported}"
        ranks = release["by_setting"][name]
        failed = [r for r in ranks if isinstance(r, str)]
        if failed:
            pytest.fail(f"{name} on megatron-core {version}:\n{failed[0]}")
        return ranks
