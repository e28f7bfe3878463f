"""The ``"gnmr"`` block of a DeepSpeed config (and of a Megatron run's GNMR config file).

    "gnmr": {
      "enabled": true,
      "backend": "act_quant",          # act_quant | fp8_emulated | int8 | te_fp8 | null (observe)
      "units": "operator",             # operator | layer
      "include": [], "exclude": [],    # glob patterns on global unit names
      "max_active": 4, "lock_steps": 8, "window": 8, "alpha": 1.5, "beta": 2.0, "warmup_steps": 8,
      "max_share": null, "latch": null, "pinned": null,   # the second policy (docs/algorithm.md)
      "low_cost": {...}, "recovery": {...},        # the backend's option blocks
      "gemms": ["fprop", "dgrad", "wgrad"],        # what a recovered unit recovers (docs/gemms.md)
      "log": {"trace": "runs/x/trace.jsonl", "monitor": true, "every": 1},
      "check_consistency": false,
      "on_missing_state": "error",     # error | fresh: a checkpoint without GNMR state
      "on_corrupt_state": "error",     # error | fresh: one whose GNMR state fails its checks
      "attribution": {"max_rest_share": 0.99, "action": "error"},  # the guard, see below
      "probe": {"every": 50, "k": 3},  # the recovery-gap probe, see below (DeepSpeed only)
      "error_every": 1                 # with gamma: measure the error sums every N-th step
    }

``attribution`` is the guard on the per-unit attribution of the gradient (megatron-core) and
``probe`` the recovery-gap probe (:mod:`gnmr_dist.distributed.probe`);
docs/deepspeed.md#the-gnmr-block gives every key's default, range and meaning.

Every key is checked before anything starts: an unknown key names the closest valid one, a bad
value names its full path (``gnmr.log.every``) and the allowed range, and the backend's option
blocks are validated by building the backend.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from gnmr_dist.backends import (
    BACKENDS,
    TORCH,
    Operators,
    PrecisionBackend,
    get_backend,
    registered_operator_types,
)
from gnmr_dist.backends.gemms import GEMMS, parse_gemms
from gnmr_dist.backends.registry import load_entry_points, unknown_backend
from gnmr_dist.core import GNMRConfig
from gnmr_dist.core.validation import check_choice, check_keys, check_positive_int
from gnmr_dist.distributed.units import check_selection

__all__ = [
    "BLOCK",
    "AttributionGuard",
    "GNMRBlock",
    "LogOptions",
    "ProbeOptions",
    "check_block_name",
    "looks_like_block",
    "read_block",
]

_UNITS = ("operator", "layer")
_ON_MISSING = ("error", "fresh")
_GUARD_ACTIONS = ("error", "warn")


@dataclass(frozen=True)
class AttributionGuard:
    """The per-step check that the per-unit norms see the gradient (``gnmr.attribution``): a
    violation stops the run or warns once (docs/megatron.md)."""

    max_rest_share: float = 0.99
    """Largest admitted share of the squared global norm outside every unit (0 < x <= 1)."""
    action: str = "error"
    """``"error"``: stop with a message naming the cause; ``"warn"``: log it once."""

    @classmethod
    def from_dict(cls, given: Mapping[str, Any] | None, path: str) -> AttributionGuard:
        given = dict(given or {})
        check_keys(given, [f.name for f in fields(cls)], path)
        share = given.get("max_rest_share", 0.99)
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
            raise ValueError(
                f"{path}.max_rest_share must be a number in (0, 1] (1 turns the share check "
                f"off), got {share!r}"
            )
        action = check_choice(given.get("action", "error"), _GUARD_ACTIONS, f"{path}.action")
        return cls(float(share), action)


CONSOLE_EVERY = 25
"""Default steps between two console lines (about a dozen in a 300-step run)."""


@dataclass(frozen=True)
class LogOptions:
    """Where decisions go."""

    trace: str | None = None
    """JSON-lines trace of per-step norms and decisions, written by rank 0 (None: off)."""
    monitor: bool = True
    """Send telemetry to DeepSpeed's monitor (tensorboard / csv_monitor / wandb) when enabled."""
    every: int = 1
    """Send the monitor's telemetry every this many optimizer steps (the trace records every
    step)."""
    console: int = CONSOLE_EVERY
    """Print the console line every this many optimizer steps; 0 (``false`` in a config): never
    (:mod:`gnmr_dist.integrations.console`)."""

    @classmethod
    def from_dict(cls, given: Mapping[str, Any] | None, path: str) -> LogOptions:
        given = dict(given or {})
        check_keys(given, [f.name for f in fields(cls)], path)
        trace = given.get("trace")
        if trace is not None and not isinstance(trace, str):
            raise ValueError(f"{path}.trace must be a file path or null, got {trace!r}")
        monitor = given.get("monitor", True)
        if not isinstance(monitor, bool):
            raise ValueError(f"{path}.monitor must be true or false, got {monitor!r}")
        every = check_positive_int(given.get("every", 1), f"{path}.every")
        return cls(trace, monitor, every, _console_every(given.get("console", CONSOLE_EVERY), path))


def _console_every(value: Any, path: str) -> int:
    """``log.console``: a positive step count, or ``false`` (0) for none."""
    if value is False or (isinstance(value, int) and not isinstance(value, bool) and value == 0):
        return 0
    if value is True:
        raise ValueError(
            f"{path}.console must be a number of steps (e.g. 25) or false, got true; write the "
            "number of steps between two lines"
        )
    return check_positive_int(value, f"{path}.console")


@dataclass(frozen=True)
class ProbeOptions:
    """When the recovery-gap probe runs and how many units the graded sets hold (``gnmr.probe``)."""

    every: int
    """Probe every optimizer step ``t`` with ``t % every == 0`` (GNMR's 1-based step numbers)."""
    k: int = 3
    """Size of the risk's top-k (and of the random, error and oracle sets of the report)."""

    @classmethod
    def from_dict(cls, given: Any, path: str) -> ProbeOptions | None:
        """Parse ``{"every": N, "k": 3}``; ``None`` (absent or null) means no probe."""
        if given is None:
            return None
        if not isinstance(given, Mapping):
            raise ValueError(
                f'{path} must be a mapping like {{"every": N, "k": 3}}, or null for no '
                f"probe; got {given!r}"
            )
        check_keys(given, [f.name for f in fields(cls)], path)
        if "every" not in given:
            raise ValueError(
                f'{path} needs "every": N (probe every N-th optimizer step, an integer >= 1); '
                f"or drop {path} to run without the probe"
            )
        every = _probe_int(
            given["every"],
            f"{path}.every",
            f"N: probe every N-th optimizer step; drop {path} to run without the probe",
        )
        return cls(every, _probe_int(given.get("k", 3), f"{path}.k", "the graded sets' size"))

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` is a probe step."""
        return step % self.every == 0

    def check_units(self, num_units: int, path: str = "gnmr.probe") -> None:
        """``ValueError`` unless ``k <= num_units`` (checked once the model's units are known)."""
        if self.k > num_units:
            raise ValueError(
                f"{path}.k ({self.k}) is larger than the number of units ({num_units}): the "
                f"graded sets hold k units; set {path}.k to at most {num_units}"
            )


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{path} must be true or false, got {value!r}")
    return value


def _probe_int(value: Any, path: str, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{path} must be an integer >= 1 ({meaning}), got {value!r}")
    return value


def _backend(value: Any, path: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(
            f"{path} must be a backend name ({sorted(BACKENDS)}) or null to observe without "
            f"recovering, got {value!r}"
        )
    if value not in BACKENDS:
        load_entry_points()  # an installed package's own backends
    if value in BACKENDS:
        return value
    raise ValueError(unknown_backend(value, path, null=True))


def _patterns(value: Any, path: str) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{path} must be a list of glob patterns, got {value!r}")
    return tuple(value)


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{path} must be a mapping (JSON object), got {value!r}")
    return dict(value)


def _parser(parse: Callable[[Any, str], Any]) -> dict[str, Any]:
    """The metadata of a :class:`GNMRBlock` field that is a key of the block: the function that
    parses and checks its value (``parse(value, "gnmr.<key>")``); an absent key keeps the
    field's default."""
    return {"parse": parse}


@dataclass(frozen=True)
class GNMRBlock:
    """The parsed ``"gnmr"`` block: each field below is a key of the block (its parser in the
    field's metadata), and the controller's keys (:class:`~gnmr_dist.core.GNMRConfig`'s fields:
    ``max_active``, ``alpha``, ``gamma``, ...) sit at the same level and land in :attr:`policy`.
    Immutable and free of built objects: the backend is built from it
    (:meth:`build_backend`), with the operators of the integration that runs it."""

    enabled: bool = field(default=True, metadata=_parser(_bool))
    """``false``: the block is read and checked, and the run has no GNMR."""
    backend: str | None = field(default=None, metadata=_parser(_backend))
    """The precision backend's registered name; ``null``: observe without recovering."""
    units: str = field(
        default="operator", metadata=_parser(lambda v, p: check_choice(v, _UNITS, p))
    )
    """``"operator"`` (each projection) or ``"layer"`` (each transformer layer)."""
    include: tuple[str, ...] = field(default=(), metadata=_parser(_patterns))
    """Glob patterns on global unit names (default: every unit inside a layer)."""
    exclude: tuple[str, ...] = field(default=(), metadata=_parser(_patterns))
    """Glob patterns removed after ``include``."""
    low_cost: Mapping[str, Any] = field(default_factory=dict, metadata=_parser(_mapping))
    """The backend's ``low_cost`` option block (parsed by the backend)."""
    recovery: Mapping[str, Any] = field(default_factory=dict, metadata=_parser(_mapping))
    """The backend's ``recovery`` option block (parsed by the backend)."""
    gemms: tuple[str, ...] = field(default=GEMMS, metadata=_parser(parse_gemms))
    """The GEMMs (``"fprop"``, ``"dgrad"``, ``"wgrad"``) a unit on the recovery path runs with
    the recovery path's numerics, the others keeping the low-cost path's (default all three: the
    whole recovery path). A backend that cannot run the subset refuses it when it is built."""
    log: LogOptions = field(
        default_factory=LogOptions,
        metadata=_parser(lambda v, p: LogOptions.from_dict(_mapping(v, p), p)),
    )
    """Where decisions go: the trace file, the framework's monitor, the console line."""
    check_consistency: bool = field(default=False, metadata=_parser(_bool))
    """Check every step that all ranks took the same decision (one extra all-gather of a hash)."""
    on_missing_state: str = field(
        default="error", metadata=_parser(lambda v, p: check_choice(v, _ON_MISSING, p))
    )
    """``"fresh"``: start the controller fresh when a checkpoint holds no GNMR state (default
    ``"error"``: refuse to resume)."""
    on_corrupt_state: str = field(
        default="error", metadata=_parser(lambda v, p: check_choice(v, _ON_MISSING, p))
    )
    """``"fresh"``: start the controller fresh when a checkpoint's GNMR state is unreadable or
    fails its checksum or invariants (default ``"error"``: refuse to resume)."""
    attribution: AttributionGuard = field(
        default_factory=AttributionGuard,
        metadata=_parser(lambda v, p: AttributionGuard.from_dict(_mapping(v, p), p)),
    )
    """The per-step guard on the per-unit attribution of the gradient (megatron-core)."""
    probe: ProbeOptions | None = field(default=None, metadata=_parser(ProbeOptions.from_dict))
    """The recovery-gap probe (``None``: off, the default)."""
    error_every: int = field(default=1, metadata=_parser(check_positive_int))
    """Measure the error sums of the damage term (docs/algorithm.md#damage-term) every this many
    steps, carrying the score forward in between (needs ``gamma``; 1: every step; when not
    given, the backend's ``default_error_every``: 1, for ``te_fp8`` 50 to 200 by recipe)."""
    policy: GNMRConfig = field(default_factory=GNMRConfig)
    """The controller's settings, read from the controller's keys at the block's top level."""

    @property
    def measure_errors_every(self) -> int | None:
        """Every how many steps the damage term's error sums are measured: ``error_every`` while
        ``gamma`` is set, ``None`` while the error term is off. Decided here once; the
        integrations read this fact (and the runtime's plan, :attr:`Plan.measure_errors
        <gnmr_dist.distributed.Plan.measure_errors>`, for each step), never ``gamma`` again."""
        return self.error_every if self.policy.gamma is not None else None

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every key a ``"gnmr"`` block may hold: the block's fields and the controller's."""
        own = tuple(f.name for f in fields(cls) if "parse" in f.metadata)
        return own + tuple(GNMRConfig.field_names())

    @classmethod
    def of(cls, given: GNMRBlock | Mapping[str, Any] | None, path: str = "gnmr") -> GNMRBlock:
        """``given`` itself when it is parsed already (no second parse), else
        :meth:`from_dict`: what every integration calls on the block it is handed."""
        return given if isinstance(given, GNMRBlock) else cls.from_dict(given, path=path)

    def check_units(self, model: Any) -> None:
        """``ValueError`` naming the model's units when ``units`` / ``include`` / ``exclude``
        select none of ``model`` (a module or its chunks), before anything is built: the same
        search the run makes (every registered operator type, whatever the backend)."""
        check_selection(
            model,
            granularity=self.units,
            include=self.include,
            exclude=self.exclude,
            operator_types=registered_operator_types(),
        )

    def build_backend(self, operators: Operators = TORCH) -> PrecisionBackend | None:
        """A new backend of this block (``None`` for ``backend: null``) that knows the
        integration's ``operators`` (:mod:`gnmr_dist.backends.operators`)."""
        if self.backend is None:
            return None
        return get_backend(
            self.backend,
            low_cost=self.low_cost,
            recovery=self.recovery,
            operators=operators,
            gemms=None if self.gemms == GEMMS else self.gemms,
        )

    @classmethod
    def from_dict(cls, block: Mapping[str, Any] | None, path: str = "gnmr") -> GNMRBlock:
        """Parse and validate the block; ``None`` (no block) means disabled."""
        if block is None:
            return cls(enabled=False)
        check_keys(block, cls.keys(), path)
        values = {
            f.name: f.metadata["parse"](block[f.name], f"{path}.{f.name}")
            for f in fields(cls)
            if "parse" in f.metadata and f.name in block
        }
        policy = {k: v for k, v in block.items() if k in GNMRConfig.field_names()}
        config = GNMRConfig.from_dict(policy, path=path)
        backend = values.get("backend")
        if "error_every" not in block and config.gamma is not None and backend in BACKENDS:
            low_cost = values.get("low_cost", {})
            values["error_every"] = BACKENDS[backend].default_error_every(low_cost)
        parsed = cls(**values, policy=config)
        parsed._check_together(path)
        return parsed

    def _check_together(self, path: str) -> None:
        """The keys that need another: ``probe`` and ``gemms`` a backend, ``error_every`` a
        ``gamma``, ``gamma`` a backend that reports error sums and a ``gemms`` with wgrad."""
        if self.probe is not None and self.backend is None:
            raise ValueError(
                f"{path}.probe needs a precision backend: with {path}.backend=null (observe "
                "only) every unit runs one path and there is nothing to compare; set "
                f"{path}.backend or drop {path}.probe"
            )
        if self.gemms != GEMMS and self.backend is None:
            raise ValueError(
                f"{path}.gemms={list(self.gemms)} needs a precision backend: with "
                f"{path}.backend=null (observe only) nothing is recovered; set {path}.backend "
                f"or drop {path}.gemms"
            )
        scored = self.measure_errors_every is not None
        if scored:
            _check_error_source(self.backend, path)
        if scored and "wgrad" not in self.gemms:
            raise ValueError(
                f"{path}.gamma scores the damage term e, a bound on what the low-cost numerics "
                f"do to the weight gradient (the wgrad GEMM); with {path}.gemms="
                f"{list(self.gemms)} a recovered unit keeps wgrad on the low-cost path, so its "
                "recovery cannot remove what e measures and a unit selected for e would stay "
                f"selected unrepaired; add 'wgrad' to {path}.gemms or drop {path}.gamma"
            )
        if self.error_every != 1 and not scored:
            raise ValueError(
                f"{path}.error_every={self.error_every} needs {path}.gamma (the error term it "
                f"paces); set {path}.gamma or drop {path}.error_every"
            )


def _check_error_source(backend: str | None, path: str) -> None:
    """``ValueError`` unless ``backend``'s class reports the per-unit error sums ``gamma``
    scores (:attr:`~gnmr_dist.backends.base.PrecisionBackend.reports_errors`), so the block is
    refused where it is read: by ``gnmr-launch check``, a program's preflight and Megatron-LM's
    argument check alike, before any process or model exists."""
    if backend is not None and BACKENDS[backend].reports_errors:
        return
    reporting = sorted(name for name, cls in BACKENDS.items() if cls.reports_errors)
    key = path.rpartition(": ")[2]  # "gnmr", without the file a program names it in
    if backend is None:
        which = f"{key}.backend=null (observe only) runs no low-cost path to measure"
    else:
        which = f"{key}.backend={backend!r} reports none (its class sets reports_errors = False)"
    raise ValueError(
        f"{path}.gamma scores the damage term e = B(u) / G, which needs per-unit error sums B(u) "
        f"from the precision backend (docs/algorithm.md#damage-term); {which}: set "
        f"{key}.backend to one that reports them ({', '.join(reporting)}) or drop {key}.gamma"
    )


BLOCK = "gnmr"
"""The one name of the block in a DeepSpeed config (and in a DeepSpeed-style GNMR config)."""


def _edit_distance(a: str, b: str) -> int:
    """Optimal string alignment distance: insertions, deletions, substitutions and swaps of two
    neighbouring characters each cost 1 (``"gmnr"`` is 1 from ``"gnmr"``)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i, ca in enumerate(a, 1):
        for j, cb in enumerate(b, 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[-1][-1]


def looks_like_block(key: object) -> bool:
    """Whether a config key is a misspelt ``"gnmr"``: not the name itself, but the name in
    another case, with separators or words around it (``"GNMR"``, ``"gnmr_block"``), one edit
    away from it, or its four letters in another order (``"gmnr"``, ``"gmrn"``)."""
    if not isinstance(key, str) or key == BLOCK:
        return False
    letters = "".join(c for c in key.lower() if c.isalnum())
    return (
        BLOCK in letters  # one edit that adds a separator or a case change leaves the name
        or _edit_distance(letters, BLOCK) <= 1
        or sorted(letters) == sorted(BLOCK)
    )


def check_block_name(config: Mapping[str, Any], where: str) -> None:
    """Refuse a config whose GNMR block is misspelt: without a ``"gnmr"`` key, every key that
    :func:`looks_like_block` is named, with the fix. A misspelt block would otherwise be ignored
    by DeepSpeed and GNMR alike, and the run would train without the settings it was given."""
    if BLOCK in config:
        return
    near = [repr(k) for k in config if looks_like_block(k)]
    if near:
        raise ValueError(
            f"{where}: unknown top-level key {', '.join(near)}; did you mean 'gnmr'? GNMR reads "
            f'its settings only from a block named exactly "gnmr": rename the key (or remove it '
            "to train without GNMR)"
        )


def read_block(
    given: GNMRBlock | Mapping[str, Any] | None,
    path: str = "gnmr",
    *,
    operators: Operators = TORCH,
    check_host: bool = True,
) -> tuple[GNMRBlock, PrecisionBackend | None]:
    """The one reader of a ``"gnmr"`` block for a program's preflight: the block, parsed
    (:meth:`GNMRBlock.of`), and its backend, built with ``operators`` to check its option blocks
    (``None`` when the block is disabled, observes only, or ``check_host`` is off and this host
    cannot load the backend).

    A backend this host cannot load (``te_fp8`` without Transformer Engine or CUDA) raises
    ``ValueError`` with the reason when ``check_host``; without it (a login node checking a
    GPU job) only the option blocks are checked, which the backend parses before it imports.
    The integration that runs the block builds its own backend with its framework's operators.
    """
    block = GNMRBlock.of(given, path)
    if not block.enabled:
        return block, None
    try:
        return block, block.build_backend(operators)
    except ImportError as err:  # the options parsed; the package or the hardware is missing
        if check_host:
            raise ValueError(str(err)) from None
    return block, None
