"""Errors of the sharded store (:mod:`embstore.ray`), importable without Ray."""

from __future__ import annotations

__all__ = ["ShardLostError", "StaleStepError"]


class ShardLostError(RuntimeError):
    """A shard of a sharded store died (its process, actor or node is gone).

    ``shard`` is its index; ``applied`` says whether the call it was running took effect
    there: ``"no"`` (it did not run, or it changes nothing, like a lookup) or ``"unknown"``
    (an apply may or may not have been applied before the shard died). ``cause`` is the
    engine's error, if any.
    """

    def __init__(self, shard: int, applied: str, cause: BaseException | None = None) -> None:
        if applied not in ("no", "unknown"):
            msg = f"applied must be 'no' or 'unknown', got {applied!r}"
            raise ValueError(msg)
        self.shard = shard
        self.applied = applied
        self.cause = cause
        why = f": {type(cause).__name__}" if cause is not None else ""
        super().__init__(
            f"shard {shard} was lost (call applied: {applied}){why}; with restore='fail' the "
            "store refuses calls until restore(dir) rolls every shard back to one checkpoint"
        )

    def __reduce__(self) -> tuple[type[ShardLostError], tuple[int, str, None]]:
        return (type(self), (self.shard, self.applied, None))


class StaleStepError(RuntimeError):
    """An apply whose forward (step token) the shard no longer holds: the shard restarted,
    or the trainer ran more lookups than the shard keeps pending before applying."""
