"""Numbers a client wrote (in headers and ids): ASCII digits only, and a bounded count of them.

`str.isdigit()` is true for superscripts and other scripts' digits (`"²".isdigit()`), which
`int()` then refuses (`int("²")` raises) or reads (`int("٣")` is 3), and `int()` refuses a string
of more than 4,300 digits: each of these was a 500 from a header. Every number read from a
request goes through `read_count` instead of `isdigit()` and `int()`.
"""

from __future__ import annotations

import re

# 10**19 is above 2**63: more digits than this is beyond any size or offset the API handles.
MAX_DIGITS = 19
BEYOND = 10**MAX_DIGITS

_DIGITS = re.compile(r"[0-9]+")
_DIGITS_BYTES = re.compile(rb"[0-9]+")


def read_count(text: str | bytes, *, saturate: bool = False) -> int | None:
    """`text` as a non-negative integer when it is ASCII digits and nothing else (no sign, no
    spaces), else None. More than MAX_DIGITS digits is never converted: None, or BEYOND with
    `saturate` (for a bound such as a size cap or a range end, where "more than any file"
    is the meaning)."""
    digits = _DIGITS_BYTES.fullmatch(text) if isinstance(text, bytes) else _DIGITS.fullmatch(text)
    if digits is None:
        return None
    if len(text) > MAX_DIGITS:
        return BEYOND if saturate else None
    return int(text)
