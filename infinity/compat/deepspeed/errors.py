"""The one error for a DeepSpeed call, argument or value this face cannot honour.

[Note: refused, never different]
``infinity.compat.deepspeed`` runs DeepSpeed training code unchanged where infinity does what
DeepSpeed documents. Where it would do something else (model parallelism through ``mpu``,
pipeline parallelism, a switch infinity has no equivalent for), the call raises
``UnsupportedByInfinity`` naming the call and the argument, and saying what to do instead;
nothing is ignored that would change the training. Arguments that change only speed or logging
(``mem_efficient_linear``, ``pin_memory``) are accepted and said to have no effect in
docs/migrating-from-deepspeed.md.
"""

from __future__ import annotations


class UnsupportedByInfinity(NotImplementedError):
    """A DeepSpeed call or argument infinity cannot honour (see [Note: refused, never different])."""


def refuse(call: str, what: str, fix: str) -> UnsupportedByInfinity:
    """The error for ``call`` (``deepspeed.initialize(mpu=...)``): ``what`` infinity lacks, ``fix``."""
    return UnsupportedByInfinity(f"{call}: {what}; {fix}")
