"""Invalidation by generation: O(1) for any scope, stale entries dropped lazily when read.

Every entry records the generations of its six scopes (everything, its voice, its voice version,
its request tag, and that tag within its voice and within its version) as they were when its
synthesis began. An invalidation names one scope, and bumps its counter,
which makes every entry recorded under an older value stale at once. The counters live in the
disk tier's database (see DiskStore), so an invalidation survives restarts together with the
entries it covers.
"""

from __future__ import annotations

ALL = "all"
_SEP = "\x1f"
SCOPES = 6
"""Counters each entry records: see snapshot."""
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


def scope_of(voice: str | None, version: str | None, tag: str | None) -> str:
    """The scope of the entries with all the names given (None: any); a version needs its voice."""
    if voice is None:
        if version is not None:
            raise ValueError("a version names nothing without its voice")
        return ALL if tag is None else tag_scope(tag)
    scope = voice_scope(voice) if version is None else version_scope(voice, version)
    return scope if tag is None else f"{scope}{_SEP}{tag_scope(tag)}"


class Generations:
    def __init__(self) -> None:
        self._gens: dict[str, int] = {}
        self._unsaved: set[str] = set()
        """Scopes invalidated while the disk tier could not record it (off, or failing)."""

    def snapshot(self, voice: str, version: str, tag: str | None) -> tuple[int, ...]:
        """The counters of an entry's SCOPES scopes (those naming a tag are 0 for an untagged one)."""
        scopes = [ALL, voice_scope(voice), version_scope(voice, version)]
        if tag is not None:
            scopes += [scope_of(None, None, tag), scope_of(voice, None, tag), scope_of(voice, version, tag)]
        return tuple(self._gens.get(scope, 0) for scope in scopes) + (0,) * (SCOPES - len(scopes))

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
        for scope in list(self._unsaved):  # a copy: the event loop may add to it meanwhile
            self._gens[scope] = max(self._gens.get(scope, 0), stored.get(scope, 0) + 1)

    def saved(self, written: list[tuple[str, int]]) -> None:
        """These counters, at these values, are on disk now (one bumped again since stays unsaved)."""
        for scope, value in written:
            if self._gens.get(scope, 0) == value:
                self._unsaved.discard(scope)

    def pending(self) -> list[tuple[str, int]]:
        """The counters invalidated but not on disk, everything (ALL) first. (Called on the disk
        tier's thread while the event loop may mark more: sorted() works on a copy.)"""
        return [(scope, self._gens.get(scope, 0)) for scope in sorted(self._unsaved, key=lambda s: s != ALL)]

    def items(self) -> list[tuple[str, int]]:
        return list(self._gens.items())
