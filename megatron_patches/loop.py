"""Removed (issue 32): ``megatron_patches.loop.attach()`` is ``attach_from_argv()``.

Kept only so that ``import megatron_patches.loop`` and ``from megatron_patches.loop import
attach``, as scripts wrote them, fail with the message that names the new call
(``megatron_patches.REMOVED["loop"]``) instead of a bare ``ModuleNotFoundError``; the attribute
form ``megatron_patches.loop`` raises ``megatron_patches.RemovedNameError`` with it.
"""

from megatron_patches import REMOVED

raise ImportError(REMOVED["loop"], name=__name__)
