"""One command dispatcher for moerl's servers (trainer ranks serving rank 0, engine processes and Ray engine actors):
a call names a method from the server's allowlist and carries JSON arguments (tensors travel beside them); an
error becomes a reply that keeps moerl's own error types across the process boundary."""

from __future__ import annotations

from moerl import errors
from moerl.errors import EngineError, MoerlError


class Dispatcher:
    """Calls ``target``'s methods by name, only those in ``allowed``; ``who`` names the server in errors."""

    def __init__(self, target: object, allowed: tuple[str, ...], who: str):
        self.target, self.allowed, self.who = target, frozenset(allowed), who

    def call(self, op: str, *args, **kwargs):
        """``target.op(*args, **kwargs)``; ValueError naming the call and the allowed ones when ``op`` is not one."""
        if op not in self.allowed:
            raise ValueError(f"{self.who}: unknown call {op!r}; allowed: {', '.join(sorted(self.allowed))}")
        return getattr(self.target, op)(*args, **kwargs)

    def reply(self, op: str, *args, **kwargs) -> dict:
        """``call`` as a reply: ``{"ok": True, **result}`` or the error as ``{"ok": False, "type", "message"}`` (the
        server stays up)."""
        try:
            return {"ok": True, **(self.call(op, *args, **kwargs) or {})}
        except Exception as e:  # the caller raises it (check_reply)
            return {"ok": False, "type": type(e).__name__, "message": str(e)}


def check_reply(name: str, reply: dict) -> None:
    """Raise what server ``name`` replied it raised: moerl's own errors keep their type across the boundary."""
    if not reply["ok"]:
        cls = getattr(errors, reply["type"], None)
        if isinstance(cls, type) and issubclass(cls, MoerlError):
            raise cls(reply["message"])
        raise EngineError(f"{name}: {reply['type']}: {reply['message']}")
