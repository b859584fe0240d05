"""One value rendered briefly for an error message, as JSON spells it (configs, request files and
HTTP bodies are JSON): a hostile input can hold a megabyte in one field, or an integer of a
million digits, and the message must stay one short line."""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

import numpy as np

TEXT_CHARS = 40     # of a string, before it is cut


def show(value: Any) -> str:
    """null / true / 12 / 0.5 / NaN / "text" (cut at 40 characters) / a list of 3 items / an
    object / an integer of 4000 bits / a <type>."""
    if value is None:
        return "null"
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, numbers.Integral):
        v = int(value)
        return str(v) if v.bit_length() <= 128 else f"an integer of {v.bit_length()} bits"
    if isinstance(value, numbers.Real):
        try:
            v = float(value)
        except OverflowError:                    # e.g. a Fraction past float range
            return "a number beyond float range"
        return "NaN" if v != v else "Infinity" if v == math.inf else "-Infinity" if v == -math.inf else repr(v)
    if isinstance(value, str):
        text = json.dumps(value[:TEXT_CHARS])
        return text if len(value) <= TEXT_CHARS else text[:-1] + '..."'
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"
