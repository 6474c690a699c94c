"""JSON from outside nested as deep as it is long: refused, and nothing printed on the way."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from edged.bundle import MANIFEST_NAME, read_manifest
from edged.cache.record import _MAX_HEADER, _PREFIX, LAYOUT, MAGIC, CorruptEntry, decode
from edged.errors import BadInput, BundleError
from edged.messages import parse_json

NESTED = "[" * 100_000


def _request(tmp_path: Path) -> None:
    parse_json(NESTED.encode())


def _manifest(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text(NESTED, encoding="utf-8")
    read_manifest(tmp_path)


def _cache_record(tmp_path: Path) -> None:
    header = NESTED.encode()[:_MAX_HEADER]  # the most a record's header may hold: deep enough
    decode(_PREFIX.pack(MAGIC, LAYOUT, len(header)) + header, "key")


@pytest.fixture
def unraisable() -> Iterator[list[Any]]:
    """What Python could only print (an exception in a gc callback), while a collection starts
    at nearly every allocation and runs a callback in Python, as edged.metrics's does."""
    seen: list[Any] = []
    hook, threshold = sys.unraisablehook, gc.get_threshold()

    def frames(n: int) -> int:  # prometheus_client's observe goes a few calls deep
        return frames(n - 1) if n else 0

    def callback(phase: str, info: dict[str, Any]) -> None:
        frames(10)

    sys.unraisablehook = seen.append
    gc.callbacks.append(callback)
    gc.set_threshold(1)
    try:
        yield seen
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(callback)
        sys.unraisablehook = hook


@pytest.mark.parametrize(("parse", "error"), [(_request, BadInput), (_manifest, BundleError),
                                               (_cache_record, CorruptEntry)])
def test_deep_nesting_is_refused_without_a_traceback_from_the_collector(
        tmp_path: Path, unraisable: list[Any], parse: Callable[[Path], None], error: type[Exception]) -> None:
    # A client's "[[[[..." made the parser recurse to Python's limit; a collection starting there
    # ran edged.metrics's callback, which failed too, and Python printed that to the journal.
    with pytest.raises(error):
        parse(tmp_path)
    assert not unraisable, [u.exc_value for u in unraisable]
    assert gc.isenabled()
