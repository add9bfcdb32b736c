"""One environment knob: its declaration, the parser of its text and its bounds.

:mod:`radiance_ar.envs` declares every knob of the project as a :class:`Knob`; this module
is the one parser per type they share (bool, int, float, str), strict about spelling, and
the words that say what a knob accepts (error messages and the docs' settings table).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: how the boolean knobs may be spelled; an empty (or blank) value is off: ``VAR=`` in a
#: launcher script means "not set"
_BOOL_WORDS = {"1": True, "true": True, "True": True, "0": False, "false": False, "False": False,
               "": False}


@dataclass(frozen=True)
class Knob:
    """One setting: what it is called, its type, what it accepts, its default and what it
    means (markdown, for :func:`settings_table`)."""

    name: str
    type: type  # bool, int, float or str
    default: Any  # the parsed value
    doc: str
    #: int and float: the accepted range (``hi`` None: no upper bound)
    lo: float | None = None
    hi: float | None = None
    #: int and float: a value taken besides the range, meaning "off"
    off: float | None = None
    #: str: the accepted words (none: any non-empty name, checked elsewhere); int: words
    #: taken besides the integers, each parsing to itself
    words: tuple[str, ...] = ()
    #: a backend knob: the :class:`BackendSettings` field it fills
    field: str | None = None
    #: str without words: a file path, where the empty value means "none"
    path: bool = False
    #: str without words nor path: the names it takes, in words (checked where they live)
    names: str = ""

    def __post_init__(self) -> None:
        # A declaration whose default it refuses would fail only when the knob is unset.
        if not self.accepts(self.default):
            raise ValueError(f"knob {self.name}: default {self.default!r}: expected "
                             f"{self.expected}")

    @property
    def expected(self) -> str:
        """What a value must be, in words (for error messages and the docs)."""
        if self.type is bool:
            return "1 or 0 (also true / false, True / False; empty: 0)"
        if self.type is str:
            if self.path:
                return "a file path (empty: none)"
            if self.words:
                return f"one of {', '.join(self.words)}"
            return self.names or "a non-empty name"
        bounds = f">= {self.lo:g}" if self.hi is None else f"in [{self.lo:g}, {self.hi:g}]"
        if self.off is not None:
            bounds += f", or {self.off:g} (off)"
        if self.type is float:
            return f"a finite number {bounds}"
        return "".join(f"{w} or " for w in self.words) + f"an integer {bounds}"

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` (already of Python's types, not text) is in bounds."""
        if isinstance(value, str) and value in self.words:
            return True
        if self.type is str:
            return isinstance(value, str) and not self.words and (bool(value) or self.path)
        if self.type is bool:
            return isinstance(value, bool)
        numbers = int if self.type is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, numbers):
            return False
        if value == self.off:
            return True
        return math.isfinite(value) and self.lo <= value and (self.hi is None
                                                             or value <= self.hi)

    def parse(self, raw: str) -> Any:
        """The value of the text ``raw``; ``ValueError`` names the knob, the text and what
        was expected."""
        text = raw.strip()
        if self.type is bool:
            value = _BOOL_WORDS.get(text)
        elif self.type is int:
            value = text if text in self.words else _ascii_int(text)
        elif self.type is float:
            value = _plain_float(text)
        else:
            value = text
        if value is None or not self.accepts(value):
            raise ValueError(f"{self.name}={raw!r}: expected {self.expected}"
                             + (", in ASCII digits" if self.type is int else ""))
        return value

    @property
    def default_text(self) -> str:
        """The default as it would be written in the environment."""
        if self.type is bool:
            return "1" if self.default else "0"
        return f"{self.default:g}" if self.type is float else str(self.default)


def _ascii_int(text: str) -> int | None:
    # Only 0-9: int() alone would also take "1_0", "+3" and non-ASCII digits ("١٠"),
    # which no one means to write into a launcher script.
    if not (text.isascii() and text.isdigit()):
        return None
    try:
        return int(text)
    except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
        return None


def _plain_float(text: str) -> float | None:
    # The integers' spelling rule: float() also takes "1_0" and non-ASCII digits.
    if not text.isascii() or "_" in text:
        return None
    try:
        return float(text)
    except ValueError:
        return None
