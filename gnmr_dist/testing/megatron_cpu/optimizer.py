"""megatron-core's optimizers and their grad-norm / clipping helpers, on CPU tensors.

What is patched, and why:

* ``optimizer.clip_grads.{multi_tensor_applier, l2_norm_impl, multi_tensor_scale_impl}`` -> CPU
  versions built on ``torch._foreach_norm`` / ``torch._foreach_mul_``. The apex/TE kernels do
  not exist on CPU, and megatron's own fallback (``utils.local_multi_tensor_l2_norm``) builds
  its result with ``device="cuda"``. (0.17+ also has ``multi_tensor_scale_tensor_impl``; it is
  None without TE, and megatron then returns the norm as a float, as 0.16 does.)
* ``clip_grads.clip_grad_by_total_norm_fp32`` (and the name ``optimizer.optimizer`` imported)
  -> a CPU twin: the original asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``.
* ``Float16OptimizerWithFloat16Params.__init__`` and ``DistributedOptimizer.__init__`` -> the
  originals, run with ``Tensor.type()`` (no argument) reporting a CPU tensor's CUDA twin type
  (``torch.BFloat16Tensor`` reads ``torch.cuda.BFloat16Tensor``) for their duration: both sort
  parameters into fp16/bf16 and fp32 groups by comparing ``param.type()`` with the CUDA type
  strings and raise ``TypeError`` for anything else.
* ``DistributedOptimizer.{sharded_state_dict, load_state_dict,
  _set_main_param_and_optimizer_states}`` -> the originals, with what megatron's non-TE path
  (torch Adam) lacks for ``dist_checkpointing``: the optimizer state to load into is allocated
  with megatron's own ``init_state_fn`` (plus Adam's ``step``) before ``state_dict()`` asserts
  on it; ``tensor.cuda()`` is the identity and the load runs under ``no_grad``; the canonical
  checkpoint carries no per-parameter ``step`` (it is in the param groups), so the copy skips
  it; and the ONE ``step`` tensor megatron puts into every parameter's state is split into
  copies (torch Adam increments each in place: shared, it would advance once per parameter per
  step and corrupt every later bias correction -- the resumed run would silently diverge).
  Checked with ``fully_reshardable`` (DP2 -> DP1 and DP2 -> DP2 resumes).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from gnmr_dist.testing.megatron_cpu.device import _tensor_cuda_is_identity


@contextlib.contextmanager
def _tensor_type_reports_cuda() -> Iterator[None]:
    """Within the block, ``Tensor.type()`` (no argument) names a CPU tensor's CUDA twin type.

    ``torch.BFloat16Tensor`` reads ``torch.cuda.BFloat16Tensor``, and so on: the strings megatron's
    mixed-precision optimizers compare parameters against. ``Tensor.type(dtype)`` is unchanged.
    """
    original = torch.Tensor.type

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def _cpu_distopt_sharded_state_dict(original: Any) -> Any:
    """``DistributedOptimizer.sharded_state_dict`` on CPU (torch Adam, no TE/apex).

    Two gaps of megatron's non-TE path: building the state to *load into* calls ``state_dict()``,
    which reads the Adam ``step`` of every parameter's state and asserts there is one, so a
    fresh optimizer fails; megatron's own ``init_state_fn`` allocates the moments, and the
    ``step`` is set to 0 here (the loaded value replaces it). The ``fully_reshardable`` format
    gathers buffers with ``tensor.cuda()``, the identity on CPU.
    """

    @functools.wraps(original)
    def sharded_state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        is_loading = kwargs.get("is_loading", args[1] if len(args) > 1 else False)
        if is_loading and len(self.optimizer.state) == 0 and self.init_state_fn is not None:
            self.init_state_fn(self.optimizer, self.config)
            for state in self.optimizer.state.values():
                state.setdefault("step", torch.tensor(0.0))
        with _tensor_cuda_is_identity():
            return original(self, *args, **kwargs)

    return sharded_state_dict


def _cpu_distopt_load_state_dict(original: Any) -> Any:
    """``DistributedOptimizer.load_state_dict`` on CPU (torch Adam, no TE/apex).

    ``tensor.cuda()`` is the identity, and it runs under ``no_grad`` (it copies into the main
    parameters, leaves that require grad). megatron's non-TE path restores torch Adam's
    ``step`` by putting ONE tensor into every parameter's state; torch Adam increments each
    state's ``step`` in place, so the shared tensor would advance once per parameter per step and
    every later bias correction would be wrong. Each state gets its own copy back.
    """

    @functools.wraps(original)
    def load_state_dict(self: Any, state_dict: Any) -> Any:
        with torch.no_grad(), _tensor_cuda_is_identity():
            result = original(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        return result

    return load_state_dict


def _cpu_set_main_param_states(original: Any) -> Any:
    """``DistributedOptimizer._set_main_param_and_optimizer_states`` for torch Adam.

    torch Adam keeps a per-parameter ``step`` in its state; megatron's canonical checkpoint
    keeps it in the param groups (restored into every state by ``load_state_dict`` before this
    runs) and has no per-parameter ``step`` tensor, so the copy is asked for a key it lacks.
    Keys the checkpoint's tensors do not carry are left as ``load_state_dict`` set them.
    """

    @functools.wraps(original)
    def set_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> Any:
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = {**tensors, "step": step.clone()}
        return original(self, model_param, tensors)

    return set_states


def _cpu_optimizer_init(original: Any) -> Any:
    """Run a mixed-precision optimizer's ``__init__`` with ``Tensor.type()`` naming CUDA types."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        with _tensor_type_reports_cuda():
            original(self, *args, **kwargs)

    return __init__


def _cpu_multi_tensor_applier(op: Any, noop_flag: Any, tensor_lists: Any, *args: Any) -> Any:
    """CPU stand-in for apex's ``multi_tensor_applier``: call ``op`` on the whole lists."""
    return op(2048 * 32, noop_flag, tensor_lists, *args)


def _cpu_l2_norm(
    chunk_size: int, noop_flag: Any, tensor_lists: Any, per_tensor: bool, *args: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """CPU ``multi_tensor_l2norm``: ``(tensor([global L2 norm]), per-tensor norms or None)``."""
    norms = torch._foreach_norm([t.float() for t in tensor_lists[0]], 2.0)
    total = torch.linalg.vector_norm(torch.stack(norms)).reshape(1)
    return total, (torch.stack(norms) if per_tensor else None)


def _cpu_scale(chunk_size: int, noop_flag: Any, tensor_lists: Any, scale: float) -> None:
    """CPU ``multi_tensor_scale``: ``dst = src * scale`` for each pair of tensors."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _cpu_clip_grad_by_total_norm(original: Any) -> Any:
    """CPU twin of ``clip_grad_by_total_norm_fp32`` (the original asserts CUDA float grads)."""
    from megatron.core.utils import to_local_if_dtensor

    @functools.wraps(original)
    def clip_grad_by_total_norm_fp32(
        parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
    ) -> None:
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        present = [g for g in (getattr(p, attr, None) for p in parameters) if g is not None]
        grads = [to_local_if_dtensor(g).detach() for g in present]
        if any(g.dtype not in (torch.float32, torch.bfloat16) for g in grads):
            raise TypeError("clip_grad_by_total_norm_fp32 expects fp32 (or bf16) gradients")
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0 and grads:
            torch._foreach_mul_(grads, clip_coeff)

    return clip_grad_by_total_norm_fp32
