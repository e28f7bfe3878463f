"""The ``"gnmr"`` block of a DeepSpeed config (and of a Megatron run's GNMR config file).

    "gnmr": {
      "enabled": true,
      "backend": "act_quant",          # act_quant | fp8_emulated | int8 | te_fp8 | null (observe)
      "units": "operator",             # operator | layer
      "include": [], "exclude": [],    # glob patterns on global unit names
      "max_active": 4, "lock_steps": 8, "window": 8, "alpha": 1.5, "beta": 2.0, "warmup_steps": 8,
      "low_cost": {...}, "recovery": {...},        # the backend's option blocks
      "log": {"trace": "runs/x/trace.jsonl", "monitor": true, "every": 1},
      "check_consistency": false,
      "on_missing_state": "error",     # error | fresh: a checkpoint without GNMR state
      "on_corrupt_state": "error",     # error | fresh: one whose GNMR state fails its checks
      "attribution": {"max_rest_share": 0.99, "action": "error"},  # the guard, see below
      "probe": {"every": 50, "k": 3},  # the recovery-gap probe, see below (DeepSpeed only)
      "error_every": 1                 # with gamma: measure the error sums every N-th step
    }

``attribution`` is the guard on the per-unit attribution of the gradient (megatron-core): every
step, the units must receive a share of the squared global norm, the parameters outside every
unit (the "rest": embeddings, final norm, output layer) at most ``max_rest_share`` of it (0 < x
<= 1; 1 disables the share check), and no gradient may be left unattributed. A violation is an
error naming the cause (``action: "error"``) or one warning (``"warn"``).

``probe`` runs the recovery-gap probe (:mod:`gnmr_dist.distributed.probe`) on every optimizer
step divisible by ``every`` (>= 1, required): two extra forward/backward passes on that step's
weights and first micro-batch, every unit on the low-cost and on the recovery path, and records
each unit's gradient gap (and Adam update gap) in the trace with the selection figures of
:mod:`gnmr_dist.telemetry.selection` for sets of ``k`` units (>= 1, default 3, at most the number
of units). Absent or null: no probe. It needs a backend (``backend: null`` has one path, nothing
to compare) and is refused under megatron-core, ZeRO stage 3 and fp16 loss scaling
(:mod:`gnmr_dist.integrations.deepspeed` says why).

Every key is checked before anything starts: an unknown key names the closest valid one, a bad
value names its full path (``gnmr.log.every``) and the allowed range, and the backend's option
blocks are validated by building the backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gnmr_dist.backends import BACKENDS, PrecisionBackend, get_backend
from gnmr_dist.core import GNMRConfig
from gnmr_dist.core.validation import check_choice, check_keys, check_positive_int, did_you_mean

__all__ = ["AttributionGuard", "GNMRBlock", "LogOptions", "ProbeOptions", "read_block"]

_UNITS = ("operator", "layer")
_ON_MISSING = ("error", "fresh")
_GUARD_ACTIONS = ("error", "warn")


@dataclass(frozen=True)
class AttributionGuard:
    """The per-step check that the per-unit norms see the gradient (``gnmr.attribution``)."""

    max_rest_share: float = 0.99
    """Largest admitted share of the squared global norm outside every unit (0 < x <= 1)."""
    action: str = "error"
    """``"error"``: stop with a message naming the cause; ``"warn"``: log it once."""

    @classmethod
    def from_dict(cls, given: Mapping[str, Any] | None, path: str) -> AttributionGuard:
        given = dict(given or {})
        check_keys(given, ("max_rest_share", "action"), path)
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
        check_keys(given, ("trace", "monitor", "every", "console"), path)
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

    KEYS = ("every", "k")

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
        check_keys(given, cls.KEYS, path)
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


@dataclass(frozen=True)
class GNMRBlock:
    """The parsed ``"gnmr"`` block."""

    enabled: bool = True
    backend: str | None = None
    units: str = "operator"
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    policy: GNMRConfig = field(default_factory=GNMRConfig)
    low_cost: Mapping[str, Any] = field(default_factory=dict)
    recovery: Mapping[str, Any] = field(default_factory=dict)
    log: LogOptions = field(default_factory=LogOptions)
    check_consistency: bool = False
    on_missing_state: str = "error"
    on_corrupt_state: str = "error"
    """``"fresh"``: start the controller fresh when a checkpoint's GNMR state is unreadable or
    fails its checksum or invariants (default ``"error"``: refuse to resume)."""
    attribution: AttributionGuard = field(default_factory=AttributionGuard)
    probe: ProbeOptions | None = None
    """The recovery-gap probe (``None``: off, the default)."""
    error_every: int = 1
    """Measure the section 2.1 error sums every this many steps, carrying the score forward in
    between (needs ``gamma``; 1: every step)."""
    _checked: list[PrecisionBackend] = field(
        default_factory=list, init=False, repr=False, compare=False
    )
    """The backend :func:`read_block` built to check the option blocks, until
    :meth:`build_backend` hands it over (so a program builds its backend once)."""

    KEYS = (
        "enabled",
        "backend",
        "units",
        "include",
        "exclude",
        "low_cost",
        "recovery",
        "log",
        "check_consistency",
        "on_missing_state",
        "on_corrupt_state",
        "attribution",
        "probe",
        "error_every",
        *GNMRConfig.field_names(),
    )

    @classmethod
    def of(cls, given: GNMRBlock | Mapping[str, Any] | None, path: str = "gnmr") -> GNMRBlock:
        """``given`` itself when it is parsed already (no second parse), else
        :meth:`from_dict`: what every integration calls on the block it is handed."""
        return given if isinstance(given, GNMRBlock) else cls.from_dict(given, path=path)

    def build_backend(self) -> PrecisionBackend | None:
        """The block's backend (``None`` for ``backend: null``): the one :func:`read_block`
        built while checking the option blocks, handed over once, else a new one."""
        if self.backend is None:
            return None
        if self._checked:
            return self._checked.pop()
        return get_backend(self.backend, low_cost=self.low_cost, recovery=self.recovery)

    @classmethod
    def from_dict(cls, block: Mapping[str, Any] | None, path: str = "gnmr") -> GNMRBlock:
        """Parse and validate the block; ``None`` (no block) means disabled."""
        if block is None:
            return cls(enabled=False)
        check_keys(block, cls.KEYS, path)
        policy = {k: v for k, v in block.items() if k in GNMRConfig.field_names()}
        backend = _backend(block.get("backend"), f"{path}.backend")
        probe = ProbeOptions.from_dict(block.get("probe"), f"{path}.probe")
        if probe is not None and backend is None:
            raise ValueError(
                f"{path}.probe needs a precision backend: with {path}.backend=null (observe "
                "only) every unit runs one path and there is nothing to compare; set "
                f"{path}.backend or drop {path}.probe"
            )
        return cls(
            enabled=_bool(block.get("enabled", True), f"{path}.enabled"),
            backend=backend,
            units=check_choice(block.get("units", "operator"), _UNITS, f"{path}.units"),
            include=_patterns(block.get("include", ()), f"{path}.include"),
            exclude=_patterns(block.get("exclude", ()), f"{path}.exclude"),
            policy=GNMRConfig.from_dict(policy, path=path),
            low_cost=_mapping(block.get("low_cost"), f"{path}.low_cost"),
            recovery=_mapping(block.get("recovery"), f"{path}.recovery"),
            log=LogOptions.from_dict(_mapping(block.get("log"), f"{path}.log"), f"{path}.log"),
            check_consistency=_bool(
                block.get("check_consistency", False), f"{path}.check_consistency"
            ),
            on_missing_state=check_choice(
                block.get("on_missing_state", "error"), _ON_MISSING, f"{path}.on_missing_state"
            ),
            on_corrupt_state=check_choice(
                block.get("on_corrupt_state", "error"), _ON_MISSING, f"{path}.on_corrupt_state"
            ),
            attribution=AttributionGuard.from_dict(
                _mapping(block.get("attribution"), f"{path}.attribution"), f"{path}.attribution"
            ),
            probe=probe,
            error_every=_error_every(block, path),
        )


def _error_every(block: Mapping[str, Any], path: str) -> int:
    every = check_positive_int(block.get("error_every", 1), f"{path}.error_every")
    if every != 1 and block.get("gamma") is None:
        raise ValueError(
            f"{path}.error_every={every} needs {path}.gamma (the error term it paces); set "
            f"{path}.gamma or drop {path}.error_every"
        )
    return every


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
    if value in BACKENDS:
        return value
    raise ValueError(
        f"{path}: unknown backend {value!r}{did_you_mean(value, BACKENDS)} (available: "
        f"{sorted(BACKENDS)}, or null to observe without recovering)"
    )


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


def read_block(
    given: GNMRBlock | Mapping[str, Any] | None, path: str = "gnmr", *, check_host: bool = True
) -> GNMRBlock:
    """The one reader of a ``"gnmr"`` block for a program's preflight: parsed
    (:meth:`GNMRBlock.of`) and its backend's option blocks checked by building the backend,
    which the integration then takes with :meth:`GNMRBlock.build_backend` (built once).

    A backend this host cannot load (``te_fp8`` without Transformer Engine or CUDA) raises
    ``ValueError`` with the reason when ``check_host``; without it (a login node checking a
    GPU job) only the option blocks are checked, which the backend parses before it imports.
    """
    block = GNMRBlock.of(given, path)
    if block.enabled and block.backend is not None and not block._checked:
        try:
            block._checked.append(block.build_backend())  # type: ignore[arg-type]
        except ImportError as err:  # the options parsed; the package or the hardware is missing
            if check_host:
                raise ValueError(str(err)) from None
    return block
