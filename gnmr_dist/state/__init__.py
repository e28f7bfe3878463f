"""The one owner of GNMR's saved state: its formats, its checks, the plan-fitting rule, the seal.

Every layer that keeps something across a checkpoint hands it here as plain data (its
``snapshot()``) and takes it back checked (its ``restore()``); none checks, fits or seals on its
own. The ``state_dict()`` a caller hands to ``torch.save`` (a bare controller's, a runtime's, an
integration's) is that plain data sealed once, on top. Where each fact lives:

* history, locks, latches, lr peak, recovered and non-finite counts, the first non-finite norm
  of a decided step: the controller part (:mod:`.controller`, format 2), written by
  ``GNMRController.snapshot``, checked by :func:`check_state`;
* the plan that runs next, once: the controller part's ``plan`` in a bare controller's state,
  the run's ``plan_active`` in a run state (:mod:`.run`, format 3; no controller ``plan`` there);
* fitting a state to the policy a run resumes with: :func:`fit`, at every load;
* unit names, per-GEMM counts, the first non-finite norm of a skipped step, the carried error
  score, skipped steps and attempts: the run state, :func:`write_run` / :func:`read_run`;
* the run's first non-finite event: derived, never stored (the earlier of the two above,
  ``RunAccounting.first`` in :mod:`gnmr_dist.distributed.accounting`);
* the seal: :mod:`.seal`, applied once by the ``state_dict()`` whose dict is written.

This package is the lowest floor of gnmr-dist: it imports torch and numpy only, and asks the
policy through :class:`~.controller.Policy`, so the algorithm above it can use it. Writing the
bytes (atomically, kill-safe) and what a resume does with a missing or bad state are the
integrations' (:mod:`gnmr_dist.integrations.state_file`);
docs/distributed.md#state-checkpoints-and-resume.
"""

from gnmr_dist.state.controller import (
    STATE_VERSION,
    Policy,
    PolicyOf,
    StateMismatchError,
    check_state,
    fit,
    numpy_copy,
)
from gnmr_dist.state.run import RUN_FORMAT, RunState, read_run, write_run
from gnmr_dist.state.seal import CHECKSUM_KEY, StateIntegrityError, open_state, seal, unseal

__all__ = [
    "CHECKSUM_KEY",
    "RUN_FORMAT",
    "STATE_VERSION",
    "Policy",
    "PolicyOf",
    "RunState",
    "StateIntegrityError",
    "StateMismatchError",
    "check_state",
    "fit",
    "numpy_copy",
    "open_state",
    "read_run",
    "seal",
    "unseal",
    "write_run",
]
