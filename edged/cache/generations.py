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
MAX_SCOPES = 10_000
"""Counters kept at most. Each scope ever invalidated keeps one (a client clearing a new tag
every time would grow them without end); past this, invalidating a new scope clears everything
instead (AudioCache), which lets every counter but ALL start again."""


def voice_scope(voice: str) -> str:
    return f"voice{_SEP}{voice}"


def version_scope(voice: str, version: str) -> str:
    return f"version{_SEP}{voice}{_SEP}{version}"


def tag_scope(tag: str) -> str:
    return f"tag{_SEP}{tag}"


class Generations:
    def __init__(self) -> None:
        self._gens: dict[str, int] = {}
        self._unsaved: set[str] = set()
        """Scopes invalidated while the disk tier could not record it (off, or failing)."""

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
        if scope == ALL:
            # Every entry and synthesis begun before is stale through ALL alone: the other
            # counters may start again from 0 (an entry recorded under them is stale anyway).
            self._gens = {ALL: value}
            self._unsaved.clear()
        else:
            self._gens[scope] = value
        return value

    def full(self, scope: str) -> bool:
        """Whether invalidating `scope` would add a counter past MAX_SCOPES."""
        return scope not in self._gens and len(self._gens) >= MAX_SCOPES

    def unsaved(self, scope: str) -> None:
        """`scope` was invalidated but not recorded on disk: `merge` must keep it ahead of disk."""
        self._unsaved.add(scope)

    def merge(self, stored: dict[str, int]) -> None:
        """Take counters read from disk; never move a counter back. A scope invalidated while the
        disk could not record it ends up past the stored counter: else a disk tier that comes
        back (or opens late) would make the entries it invalidated fresh again."""
        for scope, value in stored.items():
            if value > self._gens.get(scope, 0):
                self._gens[scope] = value
        for scope in self._unsaved:
            self._gens[scope] = max(self._gens.get(scope, 0), stored.get(scope, 0) + 1)

    def saved(self) -> None:
        """Every counter is on disk now."""
        self._unsaved.clear()

    def items(self) -> list[tuple[str, int]]:
        return list(self._gens.items())
