"""json.loads for JSON from outside (request bodies, manifests, cache records on disk), where
nesting can be as deep as the input is long."""

from __future__ import annotations

import gc
import json
import threading
from typing import Any

_lock = threading.Lock()
_parsing = 0
"""Parses under way: the collector is back on when the last one ends (if it was on before the first)."""
_collecting = True


def loads(text: str | bytes, **options: Any) -> Any:
    """json.loads with the garbage collector paused, and nesting past the parser's depth a
    ValueError ("nested too deeply") as other malformed JSON is. Deep nesting makes the parser
    recurse to Python's limit; a collection can start at any allocation, and its callbacks
    (edged.metrics times every pause) then run at that depth, fail with a RecursionError of their
    own, and Python can only print that as a traceback."""
    global _parsing, _collecting
    with _lock:
        if _parsing == 0:
            _collecting = gc.isenabled()
        _parsing += 1
        gc.disable()
    try:
        return json.loads(text, **options)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    finally:
        with _lock:
            _parsing -= 1
            if _parsing == 0 and _collecting:
                gc.enable()
