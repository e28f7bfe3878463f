"""Units: the named parameter groups GNMR scores, with ids that every rank agrees on.

A unit is either one projection operator (``granularity="operator"``: ``nn.Linear``, LoRA
layers, and the classes the caller names: a framework's own linears, which its integration
names, and Transformer Engine's, which the backends declare) or one whole transformer layer
(``granularity="layer"``). Every parameter outside all units (embeddings,
norms between operators, final norm, output head) falls into one extra non-recoverable "rest"
slot, so the pass that yields the per-unit norms also yields the global norm.

Names are *global*: wrapper prefixes (``module.`` from DDP/Float16Module) are stripped and the
index of a transformer layer is its global layer number, so pipeline stage 1 of 2 calls its first
layer ``decoder.layers.4`` rather than ``decoder.layers.0``. A framework whose layers carry the
global number themselves names the attribute (:class:`ModelMarks`); for other models a
``layer_offset`` shifts the local index. Ranks then exchange their local names once (one
``all_gather_object`` at start) and sort the union by (global layer, position inside the
layer), which makes the id of a unit depend only on the model, not on the parallel layout: a
checkpoint taken at TP2 x PP2 resumes at TP1.

Each unit also carries its *size*, the sum of ``in x out`` over its linear operators in global
shapes (:func:`operator_shapes`), from which the compute-share budget's costs come
(docs/algorithm.md#compute-share; :meth:`UnitRegistry.costs`). The size travels in the same
start-up all-gather as the name, and ranks that read different sizes for one unit are refused.

Parameters are counted once over the tensor-parallel group: a parameter carrying one of the
framework's *sharded* marks (:class:`ModelMarks`, given by its integration) holds a distinct
shard on every TP rank; any other parameter is a replica and counts only on TP rank 0.
Parameters carrying a *shared* mark (a tied copy held by another pipeline stage) are not
counted, and a tensor reachable under two names (tied weights inside one module) is counted
once.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gnmr_dist.core.inputs import costs_from_sizes
from gnmr_dist.distributed.comm import Group, all_gather_objects, group_rank

__all__ = [
    "ModelMarks",
    "operator_shapes",
    "UnitRegistry",
    "check_selection",
    "global_param_name",
    "global_param_names",
    "is_lora_layer",
    "is_operator",
    "matches",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelMarks:
    """What a framework marks on its modules and parameters, named by its integration.

    The default marks nothing: a plain torch model, whose parameters are all replicas over the
    tensor-parallel group and whose layers are numbered by their place in their list.
    """

    layer_number: str | None = None
    """Module attribute holding the layer's *global*, 1-based number (``None``: none)."""
    sharded: tuple[str, ...] = ()
    """Parameter attributes that, when true, mark a distinct shard on every TP rank."""
    shared: tuple[str, ...] = ()
    """Parameter attributes that, when true, mark a copy counted on another rank."""

    def counted(self, param: nn.Parameter, tp_rank: int) -> bool:
        """Whether this rank counts ``param``: never a shared copy; a shard on every TP rank;
        a replica on TP rank 0 only."""
        if any(getattr(param, mark, False) for mark in self.shared):
            return False
        return any(getattr(param, mark, False) for mark in self.sharded) or tp_rank == 0


PLAIN = ModelMarks()

_LAYER_LISTS = ("layers", "h", "layer", "blocks")
_WRAPPERS = re.compile(r"^(?:module\.|_orig_mod\.|base_model\.model\.)+")
_GRANULARITIES = ("operator", "layer")


def is_lora_layer(module: nn.Module) -> bool:
    """A LoRA-adapted layer (peft's ``lora.Linear``, ``Linear8bitLt``, ...): base + adapters."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and hasattr(module, "lora_A")


def is_operator(module: nn.Module, operator_types: Collection[str] = frozenset()) -> bool:
    """True for a projection operator: ``nn.Linear``, a LoRA layer, or a module whose class is
    named in ``operator_types`` (a framework's or a backend library's, named by the caller)."""
    return (
        isinstance(module, nn.Linear)
        or type(module).__name__ in operator_types
        or is_lora_layer(module)
    )


def _int_pair(module: nn.Module, first: str, second: str) -> tuple[int, int] | None:
    a, b = getattr(module, first, None), getattr(module, second, None)
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (a, b))
    return (int(a), int(b)) if ok else None  # type: ignore[arg-type]


def _tp_size(module: nn.Module) -> int:
    tp = getattr(module, "tp_size", 1)
    return tp if isinstance(tp, int) and not isinstance(tp, bool) and tp > 0 else 1


def operator_shapes(module: nn.Module) -> list[tuple[int, int]] | None:
    """``(in, out)`` of each linear GEMM an operator runs, in *global* shapes (the whole
    tensor-parallel layer, the same on every rank); ``None`` when its shapes are not readable.

    * ``nn.Linear`` (and a LoRA layer, through its ``base_layer``): ``in_features``,
      ``out_features``;
    * megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear``: ``input_size``,
      ``output_size``, which are global (the shard is ``output_size_per_partition``);
    * Transformer Engine's ``Linear``, ``LayerNormLinear``, ``GroupedLinear`` (and megatron's
      ``TELinear`` family, which subclass them): TE divides ``out_features`` by ``tp_size``
      under ``parallel_mode="column"`` and ``in_features`` under ``"row"``, so the global
      shape multiplies that side back. A megatron expert linear with explicit expert
      communication reaches TE with ``tp_size=1``: its shard is its shape;
    * TE's ``LayerNormMLP``: two GEMMs, ``hidden -> fc1`` (``fc1_weight`` rows, twice the FFN
      width under a gated activation) and ``ffn -> hidden`` (``size_per_partition x tp_size``).
    """
    if is_lora_layer(module):
        base = module.base_layer
        return operator_shapes(base) if isinstance(base, nn.Module) else None
    if isinstance(module, nn.Linear):
        return [(module.in_features, module.out_features)]
    sizes = _int_pair(module, "input_size", "output_size")
    if sizes is not None:
        return [sizes]
    tp = _tp_size(module)
    mlp = _int_pair(module, "hidden_size", "size_per_partition")
    fc1 = getattr(module, "fc1_weight", None)
    if mlp is not None and isinstance(fc1, torch.Tensor) and fc1.dim() == 2:
        hidden, ffn = mlp
        return [(hidden, int(fc1.shape[0]) * tp), (ffn * tp, hidden)]
    shape = _int_pair(module, "in_features", "out_features")
    if shape is None:
        return None
    (n_in, n_out), mode = shape, getattr(module, "parallel_mode", None)
    if mode == "column":
        n_out *= tp
    elif mode == "row":
        n_in *= tp
    return [(n_in, n_out)]


def _unit_size(operators: Iterable[nn.Module]) -> int:
    """``sum in x out`` over the linear GEMMs of ``operators`` (0: a shape is not readable)."""
    total = 0
    for op in operators:
        shapes = operator_shapes(op)
        if not shapes:
            return 0
        total += sum(i * o for i, o in shapes)
    return total


def _size_of(layer: nn.Module, operator_types: Collection[str]) -> int:
    """:func:`_unit_size` of the operators inside a layer (one nested in another, a LoRA
    layer's ``base_layer``, is part of it)."""
    found: list[nn.Module] = []
    taken: list[str] = []
    for path, sub in layer.named_modules():
        if is_operator(sub, operator_types) and not any(path.startswith(t + ".") for t in taken):
            taken.append(path)
            found.append(sub)
    return _unit_size(found)


def _strip_wrappers(name: str) -> str:
    return _WRAPPERS.sub("", name)


def _own_number(module: nn.Module, marks: ModelMarks) -> int | None:
    """The 1-based global layer number ``module`` carries (:attr:`ModelMarks.layer_number`)."""
    number = getattr(module, marks.layer_number, None) if marks.layer_number else None
    return number if isinstance(number, int) and not isinstance(number, bool) else None


def _layer_index(
    path: str, module: nn.Module, parent: nn.Module | None, marks: ModelMarks
) -> int | None:
    """Global 0-based layer index of ``module`` at ``path``, or None if it is not a layer."""
    number = _own_number(module, marks)
    if number is not None:
        return number - 1
    head, _, tail = path.rpartition(".")
    # no global number on the module: a digit under a known layer list is the layer
    if tail.isdigit() and isinstance(parent, nn.ModuleList) and head.split(".")[-1] in _LAYER_LISTS:
        return int(tail)
    return None


@dataclass(frozen=True)
class _LocalUnit:
    name: str
    key: tuple[int, int, str]
    module_path: str
    eligible: bool
    size: int = 0
    """``sum in x out`` of its linear GEMMs in global shapes; 0: not readable."""


def _find_layers(
    model: nn.Module, layer_offset: int, marks: ModelMarks = PLAIN
) -> dict[str, tuple[str, int]]:
    """Map local module path -> (global layer path, global layer index) for every layer."""
    modules = dict(model.named_modules())
    layers: dict[str, tuple[str, int]] = {}
    for path, module in modules.items():
        parent = modules.get(path.rpartition(".")[0]) if "." in path else model
        index = _layer_index(path, module, parent, marks)
        if index is None or any(path.startswith(p + ".") for p in layers):
            continue
        # a local index (a hand-split stage) needs the stage's offset; a global number does not
        if _own_number(module, marks) is None:
            index += layer_offset
        head = _strip_wrappers(path).rpartition(".")[0]
        layers[path] = (f"{head}.{index}", index)
    return layers


def _enclosing_layer(path: str, layers: dict[str, tuple[str, int]]) -> str | None:
    for layer_path in layers:
        if path == layer_path or path.startswith(layer_path + "."):
            return layer_path
    return None


def _globalize(local_name: str, layers: dict[str, tuple[str, int]]) -> str:
    layer = _enclosing_layer(local_name, layers)
    if layer is None:
        return _strip_wrappers(local_name)
    return layers[layer][0] + local_name[len(layer) :]


def global_param_name(
    model: nn.Module, local_name: str, layer_offset: int = 0, marks: ModelMarks = PLAIN
) -> str:
    """The layout-independent name of a parameter (``decoder.layers.7.mlp.linear_fc1.weight``)."""
    return _globalize(local_name, _find_layers(model, layer_offset, marks))


def global_param_names(
    model: nn.Module, layer_offset: int = 0, marks: ModelMarks = PLAIN
) -> dict[str, str]:
    """``{local name: global name}`` of every parameter (layers found once for the model)."""
    layers = _find_layers(model, layer_offset, marks)
    return {name: _globalize(name, layers) for name, _ in model.named_parameters()}


def _every_unit(name: str, module: nn.Module) -> bool:
    return True


@dataclass(frozen=True)
class _Search:
    """How the units of a model are found (the arguments of :meth:`UnitRegistry.from_model`)."""

    granularity: str
    layer_offset: int
    operator_types: Collection[str]
    eligible_fn: Callable[[str, nn.Module], bool] = _every_unit
    marks: ModelMarks = PLAIN


def _local_units(model: nn.Module, search: _Search) -> list[_LocalUnit]:
    layers = _find_layers(model, search.layer_offset, search.marks)
    eligible_fn = search.eligible_fn
    if search.granularity == "layer":
        modules = dict(model.named_modules())
        types = search.operator_types
        return [
            _LocalUnit(
                g, (0, i, ""), path, eligible_fn(g, modules[path]), _size_of(modules[path], types)
            )
            for path, (g, i) in layers.items()
        ]
    units: list[_LocalUnit] = []
    position: dict[str, int] = {}
    taken: list[str] = []
    for path, module in model.named_modules():
        # an operator nested in another (peft's lora.Linear holds base_layer, lora_A) is part of it
        if not is_operator(module, search.operator_types) or any(
            t == "" or path.startswith(t + ".") for t in taken
        ):
            continue
        taken.append(path)
        size = _unit_size([module])
        layer = _enclosing_layer(path, layers)
        if layer is None:
            name = _strip_wrappers(path)
            units.append(_LocalUnit(name, (1, 0, name), path, eligible_fn(name, module), size))
            continue
        gpath, index = layers[layer]
        name = gpath + path[len(layer) :]
        pos = position.setdefault(layer, 0)
        position[layer] = pos + 1
        key = (0, index, f"{pos:06d}")
        units.append(_LocalUnit(name, key, path, eligible_fn(name, module), size))
    return units


def _chunk_units(chunks: Sequence[nn.Module], search: _Search) -> list[_LocalUnit]:
    """:func:`_local_units` of every model chunk; module paths become ``"<chunk>:<path>"``."""
    if len(chunks) == 1:
        return _local_units(chunks[0], search)
    return [
        _LocalUnit(u.name, u.key, f"{i}:{u.module_path}", u.eligible, u.size)
        for i, chunk in enumerate(chunks)
        for u in _local_units(chunk, search)
    ]


def matches(name: str, patterns: Sequence[str]) -> bool:
    """Whether a glob of ``patterns`` selects the unit ``name``: it matches the name, or the
    name followed by ``"."`` (everything inside the unit). So ``"*.layers.0.*"`` selects the
    operators of layer 0 *and* the layer unit ``model.layers.0`` itself: a pattern means the
    same part of the model at either granularity."""
    return any(fnmatch.fnmatchcase(n, p) for p in patterns for n in (name, name + "."))


def _select(
    units: list[_LocalUnit], include: Sequence[str], exclude: Sequence[str]
) -> list[_LocalUnit]:
    def default(unit: _LocalUnit) -> bool:
        return unit.key[0] == 0  # inside a transformer layer

    # include first, exclude after: exclude can carve a layer out of a broad include
    chosen = [u for u in units if (matches(u.name, include) if include else default(u))]
    return [u for u in chosen if not matches(u.name, exclude)]


def _nothing_selected(
    chunks: Sequence[nn.Module], search: _Search, include: Sequence[str], exclude: Sequence[str]
) -> str:
    """The error message of a selection that is empty, naming the first units there are."""
    there = [u.name for u in _chunk_units(chunks, search)]
    listed = ", ".join(there[:6]) + (f", ... ({len(there)} in all)" if len(there) > 6 else "")
    return (
        f"no units selected with units={search.granularity!r}, include={list(include)}, "
        f"exclude={list(exclude)}; the model's {search.granularity} units are: "
        f"{listed or 'none (does it have transformer layers or linear operators?)'}; fix "
        "gnmr.include / gnmr.exclude (fnmatch patterns on these global names; a pattern matches "
        "a name or the name followed by '.'), or drop them to take every unit inside a layer"
    )


def check_selection(
    model: nn.Module | Sequence[nn.Module],
    *,
    granularity: str = "operator",
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    layer_offset: int = 0,
    operator_types: Collection[str] = frozenset(),
    marks: ModelMarks = PLAIN,
) -> None:
    """``ValueError`` when ``include``/``exclude`` select no unit of ``model``, listing the
    first units it has (the arguments as :meth:`UnitRegistry.from_model`'s). Local: for
    integrations whose every rank holds the whole model (data parallel), to refuse before any
    process group work."""
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    search = _Search(granularity, layer_offset, operator_types, marks=marks)
    if not _select(_chunk_units(chunks, search), include, exclude):
        raise ValueError(_nothing_selected(chunks, search, include, exclude))


class UnitRegistry:
    """The global, ordered list of units and this rank's parameters mapped onto them.

    Build it with :meth:`from_model`. ``names[i]`` is unit ``i``; slot ``num_units`` is the rest
    bucket. ``param_slots`` maps each *counted* local parameter to its slot.
    """

    def __init__(
        self,
        names: Sequence[str],
        eligible: Sequence[bool],
        modules: dict[int, nn.Module],
        params: Sequence[nn.Parameter],
        param_slots: Sequence[int],
        param_names: Sequence[str],
        slot_of_param: dict[int, int] | None = None,
        sizes: Sequence[int] | None = None,
    ) -> None:
        self.names = tuple(names)
        self.num_units = len(self.names)
        self.eligible = torch.tensor(list(eligible), dtype=torch.bool)
        self.local_modules = modules
        self.params = list(params)
        self.param_slots = torch.tensor(list(param_slots), dtype=torch.int64)
        self.param_names = tuple(param_names)
        self.index = {n: i for i, n in enumerate(self.names)}
        counted = zip(self.params, self.param_slots.tolist(), strict=True)
        self.slot_of_param: dict[int, int] = (
            dict(slot_of_param) if slot_of_param is not None else {id(p): s for p, s in counted}
        )
        """``id(parameter) -> slot`` for EVERY local parameter, counted or not (the rest slot
        for those outside all units; :meth:`from_model` passes them all, a registry built by
        hand defaults to its counted parameters): what framework glue uses to attribute a
        gradient that the framework itself has already filtered (megatron's clip-norm list)."""
        if sizes is not None and len(sizes) != self.num_units:
            raise ValueError(f"{len(sizes)} unit sizes for {self.num_units} units")
        self.sizes: tuple[int, ...] | None = None if sizes is None else tuple(map(int, sizes))
        """Per unit, ``sum in x out`` over its linear GEMMs in global shapes, agreed by every
        rank (:func:`operator_shapes`); 0 where not readable; ``None``: not known (a registry
        built by hand without them)."""

    @classmethod
    def from_model(
        cls,
        model: nn.Module | Sequence[nn.Module],
        *,
        granularity: str = "operator",
        include: Sequence[str] = (),
        exclude: Sequence[str] = (),
        group: Group | None = None,
        tp_group: Group | None = None,
        layer_offset: int = 0,
        eligible_fn: Callable[[str, nn.Module], bool] | None = None,
        operator_types: Collection[str] = frozenset(),
        marks: ModelMarks = PLAIN,
    ) -> UnitRegistry:
        """Find the units of ``model`` and agree on their ids with every rank of ``group``.

        ``model`` may be the list of model chunks of this rank (megatron's virtual pipeline:
        several chunks, each holding non-adjacent global layers); their units are merged.

        Args:
            granularity: ``"operator"`` (each projection) or ``"layer"`` (each transformer layer).
            include: glob patterns on global unit names (:func:`matches`: a pattern also
                selects a unit it reaches inside of); default: every unit inside a layer.
            exclude: glob patterns removed after ``include`` (e.g. ``"*.layers.0.*"``: layer 0,
                as operators or as the layer unit).
            group: ranks whose units form the model (usually the world); one all-gather of
                names happens over it. ``None``: this process holds the whole model.
            tp_group: the tensor-parallel group, to count replicated parameters on TP rank 0 only.
            layer_offset: added to the layer index of models whose layers do not carry a global
                number (a hand-split pipeline stage).
            eligible_fn: ``(name, module) -> bool``: whether the unit has a recovery path;
                default: all units are eligible.
            operator_types: class names of the modules that are operators besides
                ``nn.Linear`` and LoRA layers (:func:`is_operator`); default: none. The
                integrations pass their framework's and
                :func:`gnmr_dist.backends.registered_operator_types` (Transformer Engine's
                linears), whatever the backend, so unit ids never depend on it.
            marks: the framework's marks on modules and parameters (:class:`ModelMarks`);
                default: none (a plain torch model).
        """
        if granularity not in _GRANULARITIES:
            raise ValueError(
                f"granularity must be one of {list(_GRANULARITIES)}, got {granularity!r}"
            )
        chunks = [model] if isinstance(model, nn.Module) else list(model)
        search = _Search(
            granularity, layer_offset, operator_types, eligible_fn or _every_unit, marks
        )
        local = _select(_chunk_units(chunks, search), include, exclude)
        # one all-gather of names at start: every rank then indexes units alike, so the
        # per-unit vector of each rank lines up slot for slot
        names, eligible, sizes = _agree(local, group)
        if not names:
            raise ValueError(_nothing_selected(chunks, search, include, exclude))
        return cls._bind(chunks, (names, eligible, sizes), local, group_rank(tp_group), search)

    @classmethod
    def _bind(
        cls,
        model: nn.Module | Sequence[nn.Module],
        agreed: tuple[list[str], list[bool], list[int]],
        local: list[_LocalUnit],
        tp_rank: int,
        search: _Search,
    ) -> UnitRegistry:
        chunks = [model] if isinstance(model, nn.Module) else list(model)
        names, eligible, sizes = agreed
        index = {n: i for i, n in enumerate(names)}
        path_slot = {u.module_path: index[u.name] for u in local}
        params, slots, pnames, every = [], [], [], []
        local_modules: dict[int, nn.Module] = {}
        for c, chunk in enumerate(chunks):
            prefix = f"{c}:" if len(chunks) > 1 else ""
            modules = dict(chunk.named_modules())
            for u in local:
                if u.module_path.startswith(prefix):
                    local_modules[index[u.name]] = modules[u.module_path[len(prefix) :]]
            layers = _find_layers(chunk, search.layer_offset, search.marks)
            for pname, param in chunk.named_parameters():
                slot = _slot_of(pname, path_slot, len(names), prefix)
                every.append((param, slot))
                # a TP-replicated parameter is counted on TP rank 0 only, or its norm would be
                # summed tp times; it still gets a slot (every) for the attribution
                if not search.marks.counted(param, tp_rank):
                    continue
                params.append(param)
                slots.append(slot)
                pnames.append(_globalize(pname, layers))
        slot_of_param = {id(p): s for p, s in every}
        return cls(
            names,
            eligible,
            local_modules,
            params,
            slots,
            pnames,
            slot_of_param=slot_of_param,
            sizes=sizes,
        )

    def unit_params(self, unit: int) -> list[nn.Parameter]:
        """This rank's counted parameters of ``unit`` (``num_units`` for the rest bucket)."""
        return [p for p, s in zip(self.params, self.param_slots.tolist(), strict=True) if s == unit]

    def unsized(self) -> list[str]:
        """The units whose linear shapes are not readable (all of them when no sizes are
        known): the reason :meth:`costs` is ``None``."""
        if self.sizes is None:
            return list(self.names)
        return [n for n, size in zip(self.names, self.sizes, strict=True) if size < 1]

    def costs(self, gemms: int = 3) -> tuple[list[int], int] | None:
        """``(w, W)`` of docs/algorithm.md#compute-share: ``w(u) = gemms x size(u)``, the
        multiply-accumulates per token of the ``gemms`` GEMMs a recovery covers, and ``W = 3 x
        sum size``, the units' linear work; ``None`` when a unit's size is unknown
        (:meth:`unsized`)."""
        if self.sizes is None or self.unsized():
            costs_from_sizes((), gemms)  # the GEMM count is checked all the same
            return None
        return costs_from_sizes(self.sizes, gemms)


def _slot_of(pname: str, path_slot: dict[str, int], rest: int, prefix: str = "") -> int:
    """Slot of the innermost unit module whose path prefixes ``pname`` (else the rest slot)."""
    path = pname
    while "." in path:
        path = path.rpartition(".")[0]
        if prefix + path in path_slot:
            return path_slot[prefix + path]
    # a parameter outside every unit goes to the rest slot (index U): it still adds to G
    return path_slot.get(prefix, rest)


def _agree(
    local: Iterable[_LocalUnit], group: Group | None
) -> tuple[list[str], list[bool], list[int]]:
    """One all-gather of (name, key, eligible, size); the sorted union, identical on every
    rank. Ranks that hold one unit must describe it alike: a different size means the ranks
    read different global shapes, so their compute-share costs would differ."""
    mine = [(u.name, u.key, u.eligible, u.size) for u in local]
    merged: dict[str, tuple[Any, bool, int]] = {}
    for rank, entries in enumerate(all_gather_objects(mine, group)):
        for name, key, elig, size in entries:
            seen = merged.setdefault(name, (tuple(key), elig, size))
            if seen[:2] != (tuple(key), elig):
                raise RuntimeError(
                    f"rank {rank} describes unit {name!r} as {(tuple(key), elig)}, another rank as "
                    f"{seen[:2]}: are all ranks building the same model and backend?"
                )
            if seen[2] != size:
                raise RuntimeError(
                    f"rank {rank} reads the linear shapes of unit {name!r} as {size} "
                    f"multiply-accumulates per token (sum of in x out), another rank as "
                    f"{seen[2]}: the compute-share costs must be the same on every rank "
                    "(docs/distributed.md#unit-costs). Are all ranks building the same model with "
                    "the same tensor-parallel size?"
                )
    order = sorted(merged, key=lambda n: merged[n][0])
    return order, [merged[n][1] for n in order], [merged[n][2] for n in order]
