"""Part (c) of :mod:`benchmarks.overhead`: the collectives of a step, GNMR on vs off.

A real 2-process gloo run under DeepSpeed ZeRO-1 steps a GNMR engine and a plain one on the same
batches; every collective is recorded by a wrapper around ``torch.distributed`` and by the torch
profiler's ``gloo:*`` events. With GNMR on, the extra per step must be exactly one all-reduce of
U + 1 float64 values: docs/benchmarks.md#overhead-c-collectives.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import pickle
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness.arms import Setup
from benchmarks.harness.common import gloo_world, hf_loss, skip_deepspeed_shm_comm
from benchmarks.harness.model import VOCAB, build_model
from benchmarks.overhead.config import GNMR_POLICY, backend_options, ds_config
from gnmr_dist.distributed.comm import leave_local_world, local_store

_HARNESS = Setup()
"""The harness's defaults: part (c)'s model shape."""


@dataclass(frozen=True)
class Call:
    """One collective as a rank issued it: the tensor(s) it contributes."""

    op: str
    dtype: str
    numel: int
    bytes: int


# name -> the parameter holding what this rank contributes (None: nothing, e.g. barrier)
PAYLOAD = {
    "all_reduce": "tensor",
    "all_reduce_coalesced": "tensors",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "_all_gather_base": "input_tensor",
    "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input",
    "_reduce_scatter_base": "input",
    "all_to_all_single": "input",
    "all_to_all": "input_tensor_list",
    "gather": "tensor",
    "scatter": "scatter_list",
    "all_gather_object": "obj",
    "broadcast_object_list": "object_list",
    "barrier": None,
}


def _payload(value: Any) -> tuple[str, int, int]:
    """(dtype, elements, bytes) of a tensor or a list of tensors; objects count -1 bytes."""
    if torch.is_tensor(value):
        return str(value.dtype).removeprefix("torch."), value.numel(), value.nbytes
    if isinstance(value, (list, tuple)) and value and all(torch.is_tensor(t) for t in value):
        dtype = str(value[0].dtype).removeprefix("torch.")
        return dtype, sum(t.numel() for t in value), sum(t.nbytes for t in value)
    return "object" if value is not None else "-", -1 if value is not None else 0, -1


class CommRecorder:
    """Wraps the ``torch.distributed`` collectives; records calls made inside :meth:`window`.

    Install it before DeepSpeed initialises its comm backend (which keeps references to some
    functions) and before anything else imports them by name. Calls nested inside a recorded one
    (``all_gather_object`` runs ``all_gather``) are not counted twice.
    """

    def __init__(self) -> None:
        self.calls: list[Call] | None = None
        self._depth = 0
        self._saved: list[tuple[Any, str, Any]] = []

    def install(self) -> CommRecorder:
        import torch.distributed.distributed_c10d as c10d

        for name, param in PAYLOAD.items():
            real = getattr(c10d, name, None)
            if real is None:
                continue
            wrapped = self._wrap(name, real, param)
            for mod in (dist, c10d):
                if getattr(mod, name, None) is real:
                    self._saved.append((mod, name, real))
                    setattr(mod, name, wrapped)
        return self

    def uninstall(self) -> None:
        for mod, name, real in reversed(self._saved):
            setattr(mod, name, real)
        self._saved.clear()

    def _wrap(self, name: str, real: Callable[..., Any], param: str | None) -> Callable[..., Any]:
        sig = inspect.signature(real)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self.calls is not None and self._depth == 0:
                value = sig.bind(*args, **kwargs).arguments.get(param) if param else None
                self.calls.append(Call(name, *_payload(value)))
            self._depth += 1
            try:
                return real(*args, **kwargs)
            finally:
                self._depth -= 1

        return wrapped

    @contextlib.contextmanager
    def window(self) -> Iterator[list[Call]]:
        self.calls = calls = []
        try:
            yield calls
        finally:
            self.calls = None


_DTYPE_BYTES = {
    "double": 8,
    "float": 4,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
}


def gloo_calls(prof: Any) -> list[Call]:
    """The profiler's record of what reached the gloo process group (``gloo:<op>`` events).

    Reads the raw Kineto events when torch exposes them (building ``prof.events()`` costs about
    a second per profiled training step), else the public ``FunctionEvent`` list.
    """
    kineto = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if kineto is not None:
        raw = [(e.start_ns(), e.name(), e.shapes(), e.dtypes()) for e in kineto.events()]
    else:
        raw = [(e.time_range.start, e.name, e.input_shapes, e.input_dtypes) for e in prof.events()]
    out = []
    for _, name, shapes, dtypes in sorted(raw, key=lambda r: r[0]):
        if not name.startswith("gloo:"):
            continue
        tensors = [
            (math.prod(s), d) for s, d in zip(shapes, dtypes, strict=False) if d in _DTYPE_BYTES
        ]
        numel = sum(n for n, _ in tensors)
        size = sum(n * _DTYPE_BYTES[d] for n, d in tensors)
        out.append(Call(name, tensors[0][1] if tensors else "-", numel, size))
    return out


def expected_extra(units: int) -> Counter[tuple[str, int]]:
    return Counter({("all_reduce", 8 * (units + 1)): 1})


def extra_calls(on: Sequence[Call], off: Sequence[Call], gloo: bool = False) -> dict[str, Any]:
    """What the GNMR step issued beyond the plain one, as (op, bytes) multisets."""
    key = (lambda c: (c.op.removeprefix("gloo:"), c.bytes)) if gloo else (lambda c: (c.op, c.bytes))
    a, b = Counter(map(key, on)), Counter(map(key, off))
    return {"extra": a - b, "missing": b - a}


@dataclass
class CollectiveSpec:
    """The model and run of part (c) (by default the harness Llama's shape)."""

    model: str = "llama"
    """``llama``: the harness's Llama shape; ``stack``: :class:`ProjStack` (no transformers)."""
    layers: int = _HARNESS.layers
    hidden: int = _HARNESS.hidden
    heads: int = _HARNESS.heads
    ffn: int = _HARNESS.ffn
    seq_len: int = _HARNESS.seq_len
    batch: int = _HARNESS.batch
    steps: int = 3
    stage: int = 1
    backend: str = "act_quant"
    max_active: int = 3

    def setup(self) -> Setup:
        shape = ("layers", "hidden", "heads", "ffn", "seq_len", "batch")
        return Setup(**{k: getattr(self, k) for k in shape})

    def build(self) -> nn.Module:
        if self.model == "stack":
            return ProjStack(self.layers, self.hidden, self.setup().seed)
        return build_model(self.setup())


class ProjStack(nn.Module):
    """A Llama-shaped stack of the seven projections per layer, without transformers (fast to
    import in spawned processes); ``forward`` returns an object with ``.loss`` like HF models."""

    def __init__(self, layers: int, hidden: int, seed: int, vocab: int = VOCAB) -> None:
        super().__init__()
        from benchmarks.overhead.monitor import Layer

        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        import types

        x = self.embed(input_ids)
        for m in self.layers:
            h = m.norm(x)
            x = x + m.o_proj(m.v_proj(h) * torch.sigmoid(m.q_proj(h) + m.k_proj(h)))
            x = x + m.down_proj(nn.functional.silu(m.gate_proj(x)) * m.up_proj(x))
        logits = self.head(x)[:, :-1]
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())
        return types.SimpleNamespace(loss=loss)


def independent_units(spec: CollectiveSpec) -> int:
    """U without the registry: the ``nn.Linear`` modules inside the transformer layers."""
    model = spec.build()
    layers = model.model.layers if spec.model == "llama" else model.layers
    return sum(isinstance(m, nn.Linear) for layer in layers for m in layer.modules())


def _collectives_worker(rank: int, world: int, port: int, out: str, spec: CollectiveSpec) -> None:
    torch.set_num_threads(1)
    recorder = CommRecorder().install()  # before DeepSpeed keeps references to collectives
    try:
        with gloo_world(rank, world, port):
            result = _collectives(rank, spec, recorder)
            Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
            dist.barrier()
    finally:
        recorder.uninstall()
    leave_local_world()  # the result is saved; no interpreter finalization (see its docstring)


def _engines(spec: CollectiveSpec) -> tuple[Any, Any, Any]:
    """(GNMR's engine, the plain engine, the plain engine's backend): same model, backend and
    DeepSpeed config; GNMR without warm-up, so that it decides from the first step."""
    import deepspeed

    import gnmr_dist.deepspeed as gds
    from gnmr_dist.backends import get_backend
    from gnmr_dist.distributed import UnitRegistry

    skip_deepspeed_shm_comm()
    options = backend_options()[spec.backend]
    cfg = ds_config(spec.setup(), spec.stage)
    block = {"backend": spec.backend, **options, **GNMR_POLICY, "max_active": spec.max_active}
    block.update(warmup_steps=0, log={"monitor": False})
    on, *_ = gds.initialize(model=spec.build(), config={**cfg, "gnmr": block})
    plain = spec.build()
    backend = get_backend(spec.backend, **options)
    backend.wrap(UnitRegistry.from_model(plain, granularity="operator").local_modules)
    off, *_ = deepspeed.initialize(model=plain, config=cfg)
    return on, off, backend


def _collectives(rank: int, spec: CollectiveSpec, recorder: CommRecorder) -> dict[str, Any]:
    """Per step, the calls of the plain step and then of GNMR's, on the same batch: as the
    wrapper recorded them and as the profiler saw them reach gloo."""
    from torch.profiler import ProfilerActivity, profile

    setup = spec.setup()
    on, off, backend = _engines(spec)
    steps: dict[str, list[dict[str, list[Call]]]] = {"on": [], "off": []}
    for step in range(1, spec.steps + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, VOCAB, (setup.batch, setup.seq_len), generator=g)
        for name, engine in (("off", off), ("on", on)):
            if name == "off":
                backend.apply((), step)
            profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            with recorder.window() as calls, profiler as prof:
                loss = hf_loss(engine, tokens)
                engine.backward(loss)
                engine.step()
            steps[name].append({"wrapper": list(calls), "gloo": gloo_calls(prof)})
    return {
        "units": on.gnmr.registry.num_units,
        "steps": steps,
        "active": [sorted(on.gnmr.runtime.plan.active)],
        "decisions": on.gnmr.runtime.controller.step_count,
    }


def run_collectives(spec: CollectiveSpec, world: int = 2) -> list[dict[str, Any]]:
    """Every rank's per-step calls (wrapper and profiler), GNMR on and off."""
    import torch.multiprocessing as mp

    store = local_store()  # bound here: the workers join it, no port picked and bound later
    with tempfile.TemporaryDirectory() as out:
        args = (world, store.port, out, spec)
        mp.start_processes(
            _collectives_worker, args=args, nprocs=world, join=True, start_method="spawn"
        )
        return [pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in range(world)]


def part_c(spec: CollectiveSpec) -> dict[str, Any]:
    """The 2-rank run of ``spec``: per rank and step, the calls and bytes GNMR on and off, and
    whether the extra is exactly one all-reduce of 8 (U + 1) bytes on every rank and step."""
    ranks = run_collectives(spec)
    units = independent_units(spec)
    rows = []
    for rank, res in enumerate(ranks):
        steps = zip(res["steps"]["on"], res["steps"]["off"], strict=True)
        for i, (on, off) in enumerate(steps):
            rows.append(_step_row(rank, i + 1, on, off, res["units"] == units, units))
    off_ops = Counter(c.op for c in ranks[0]["steps"]["off"][-1]["wrapper"])
    return {
        "units_registry": ranks[0]["units"],
        "units_independent": units,
        "expected_extra_bytes": 8 * (units + 1),
        "rows": rows,
        "ok": all(row["ok"] for row in rows),
        "plain_step_ops": dict(off_ops),
        "spec": asdict(spec),
    }


def _step_row(
    rank: int, step: int, on: dict[str, Any], off: dict[str, Any], same_u: bool, units: int
) -> dict[str, Any]:
    """One rank's step: calls and bytes off and on (wrapper and profiler), the extra calls of
    each, and ``ok``: the registry counts U as the model does (``same_u``), both records see
    exactly the expected extra all-reduce, nothing missing, and the extra payload is float64."""
    ex_w = extra_calls(on["wrapper"], off["wrapper"])
    ex_g = extra_calls(on["gloo"], off["gloo"], gloo=True)
    good = (
        same_u
        and ex_w["extra"] == ex_g["extra"] == expected_extra(units)
        and not ex_w["missing"]
        and not ex_g["missing"]
        and [c.dtype for c in on["wrapper"] if c not in off["wrapper"]] == ["float64"]
    )
    row: dict[str, Any] = {"rank": rank, "step": step}
    for arm, calls in (("off", off), ("on", on)):
        for src in ("wrapper", "gloo"):
            tag = "" if src == "wrapper" else "_gloo"
            row[f"{arm}{tag}_calls"] = len(calls[src])
            row[f"{arm}{tag}_bytes"] = sum(c.bytes for c in calls[src])
    row["extra"] = sorted(ex_w["extra"].elements())
    row["extra_gloo"] = sorted(ex_g["extra"].elements())
    row["ok"] = good
    return row
