"""Invalidation by generation: O(1) for any scope, stale entries dropped lazily when read.

Every entry records the generations of its four scopes (everything, its voice, its voice version,
its request tag) as they were when its synthesis began. Invalidating a scope bumps its counter,
which makes every entry recorded under an older value stale at once. The counters live in the
disk tier's database (see DiskStore), so an invalidation survives restarts together with the
entries it covers.
"""

from __future__ import annotations

ALL = "all"
_SEP = "\x1f"


def voice_scope(voice: str) -> str:
    return f"voice{_SEP}{voice}"


def version_scope(voice: str, version: str) -> str:
    return f"version{_SEP}{voice}{_SEP}{version}"


def tag_scope(tag: str) -> str:
    return f"tag{_SEP}{tag}"


class Generations:
    def __init__(self) -> None:
        self._gens: dict[str, int] = {}

    def snapshot(self, voice: str, version: str, tag: str | None) -> tuple[int, int, int, int]:
        get = self._gens.get
        return (
            get(ALL, 0),
            get(voice_scope(voice), 0),
            get(version_scope(voice, version), 0),
            get(tag_scope(tag), 0) if tag is not None else 0,
        )

    def bump(self, scope: str) -> int:
        value = self._gens.get(scope, 0) + 1
        self._gens[scope] = value
        return value

    def merge(self, stored: dict[str, int]) -> None:
        """Take counters read from disk; never move a counter back."""
        for scope, value in stored.items():
            if value > self._gens.get(scope, 0):
                self._gens[scope] = value

    def items(self) -> list[tuple[str, int]]:
        return list(self._gens.items())
