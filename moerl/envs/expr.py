"""A small, bounded integer-expression evaluator for model output (countdown answers, calculator tool calls).

Grammar (whitespace between tokens allowed)::

    expr  := term (("+" | "-") term)*
    term  := unary (("*" | "/") unary)*
    unary := ("+" | "-") unary | atom
    atom  := INT | "(" expr ")"

Only ASCII digits, ``+ - * / ( )``, spaces and tabs are accepted; anything else (names, dots, brackets, quotes,
unicode digits, ``**``) is an :class:`ExprError`. Hard limits keep every call cheap whatever the input: the text
length (checked before anything else), the nesting depth of parentheses and unary signs, and the magnitude of every
literal and intermediate value. Division must be exact: ``7/2`` and ``1/0`` are errors. Nothing is ever passed to
``eval``.
"""

from __future__ import annotations

from typing import NamedTuple

DIGITS = frozenset("0123456789")
OPERATORS = frozenset("+-*/()")
SPACES = frozenset(" \t")


class ExprError(ValueError):
    """The text is not an expression within the evaluator's grammar or limits."""


class Evaluated(NamedTuple):
    """An expression's value and the integer literals it used, in order of appearance."""

    value: int
    literals: tuple[int, ...]


def tokenize(text: str) -> list[str]:
    """Split ``text`` into integer literals and single-character operators; raise ExprError on any other char."""
    tokens: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c in DIGITS:
            j = i
            while j < len(text) and text[j] in DIGITS:
                j += 1
            tokens.append(text[i:j])
            i = j
        elif c in OPERATORS:
            tokens.append(c)
            i += 1
        elif c in SPACES:
            i += 1
        else:
            raise ExprError(f"character {c!r} at {i} is not allowed")
    return tokens


class _Parser:
    def __init__(self, tokens: list[str], max_depth: int, max_abs: int) -> None:
        self.tokens, self.pos, self.max_depth, self.max_abs = tokens, 0, max_depth, max_abs
        self.literals: list[int] = []

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str | None:
        tok = self.peek()
        self.pos += 1
        return tok

    def bounded(self, value: int) -> int:
        if abs(value) > self.max_abs:
            raise ExprError(f"a value exceeds the magnitude limit {self.max_abs}")
        return value

    def expr(self, depth: int) -> int:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op, rhs = self.take(), self.term(depth)
            value = self.bounded(value + rhs if op == "+" else value - rhs)
        return value

    def term(self, depth: int) -> int:
        value = self.unary(depth)
        while self.peek() in ("*", "/"):
            op, rhs = self.take(), self.unary(depth)
            if op == "*":
                value = self.bounded(value * rhs)
            elif rhs == 0:
                raise ExprError("division by zero")
            elif value % rhs:
                raise ExprError(f"{value}/{rhs} is not an exact division")
            else:
                value //= rhs
        return value

    def unary(self, depth: int) -> int:
        if depth >= self.max_depth:
            raise ExprError(f"nesting deeper than {self.max_depth}")
        tok = self.peek()
        if tok in ("+", "-"):
            self.take()
            value = self.unary(depth + 1)
            return -value if tok == "-" else value
        return self.atom(depth)

    def atom(self, depth: int) -> int:
        tok = self.take()
        if tok == "(":
            value = self.expr(depth + 1)
            if self.take() != ")":
                raise ExprError("unbalanced parentheses")
            return value
        if tok is None or tok[0] not in DIGITS:
            raise ExprError(f"expected a number, got {tok!r}")
        if len(tok) > len(str(self.max_abs)):  # never int() a long digit string
            raise ExprError(f"literal {tok[:20]}... exceeds the magnitude limit {self.max_abs}")
        value = self.bounded(int(tok))
        self.literals.append(value)
        return value


def evaluate(text: str, *, max_len: int = 64, max_depth: int = 16, max_abs: int = 10**12) -> Evaluated:
    """Evaluate an integer expression of ``+ - * /`` and parentheses within hard limits.

    Raises ExprError when ``text`` is longer than ``max_len`` characters, nests parentheses or unary signs deeper than
    ``max_depth``, has a literal or intermediate value above ``max_abs`` in magnitude, divides inexactly or by zero,
    or is not in the grammar. Cost is linear in ``min(len(text), max_len)``.
    """
    if len(text) > max_len:
        raise ExprError(f"expression longer than {max_len} characters")
    tokens = tokenize(text)
    if not tokens:
        raise ExprError("empty expression")
    parser = _Parser(tokens, max_depth, max_abs)
    value = parser.expr(0)
    if parser.pos != len(tokens):
        raise ExprError(f"unexpected {tokens[parser.pos]!r} after the expression")
    return Evaluated(value, tuple(parser.literals))
