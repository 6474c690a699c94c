"""Resident memory of a process and the processes it started, as the kernel counts it in
/proc/<pid>/status (anonymous memory: in /proc/<pid>/smaps_rollup, shared pages shared out).

Anonymous memory (heap, arenas, copied weights) is what a box cannot get back under pressure;
file pages (memory-mapped weights, shared libraries) are clean and reclaimable. Telling the two
apart is the point of mapping weights from external-data files, so both are reported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

_FIELDS = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem", "VmHWM": "peak"}


@dataclass(frozen=True)
class MemoryFigures:
    """Resident memory of one process at one moment, in MiB."""

    rss: float
    """All resident pages (anonymous, file and shmem; shared ones counted in each process)."""
    anon: float
    """Resident anonymous pages, each shared page counted in part by each process sharing it
    (Pss_Anon): edged's espeak-ng child keeps a fork of itself ready, which shares its pages."""
    file: float
    """Resident file-backed pages (mapped weights and libraries)."""
    shmem: float
    peak: float
    """Highest rss the process has had so far (VmHWM; with children, the sum of their highs)."""

    def as_dict(self) -> dict[str, float]:
        return {name: round(value, 1) for name, value in asdict(self).items()}


def read_memory(pid: int | str = "self") -> MemoryFigures:
    """The figures of a live process together with the processes it started (edged's espeak-ng
    runs in a child of its own); ProcessLookupError if the process has gone."""
    try:
        text = (Path("/proc") / str(pid) / "status").read_text()
    except FileNotFoundError:
        raise ProcessLookupError(f"no process {pid}") from None
    try:
        shared = _proportional_anon(pid)
    except OSError:  # ended meanwhile, another user's, or no smaps_rollup: RssAnon stands
        shared = None
    total = parse_status(text)
    if shared is not None:
        total = MemoryFigures(**{**asdict(total), "anon": shared})
    for child in _children(pid):
        try:
            figures = read_memory(child)
        except (ProcessLookupError, ValueError):
            continue  # it ended meanwhile
        total = MemoryFigures(**{k: v + getattr(figures, k) for k, v in asdict(total).items()})
    return total


def _proportional_anon(pid: int | str) -> float | None:
    """Pss_Anon of /proc/<pid>/smaps_rollup in MiB; None where the kernel has no such line (< 5.0)."""
    for line in (Path("/proc") / str(pid) / "smaps_rollup").read_text().splitlines():
        if line.startswith("Pss_Anon:"):
            return int(line.split()[1]) / 1024
    return None


def _children(pid: int | str) -> list[int]:
    children: list[int] = []
    for task in (Path("/proc") / str(pid) / "task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return children


def parse_status(text: str) -> MemoryFigures:
    """The memory fields of a /proc/<pid>/status text (values in kB there, MiB here)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in _FIELDS:
            value, _, unit = rest.strip().partition(" ")
            if unit != "kB":
                raise ValueError(f"unexpected unit in /proc status line: {line!r}")
            found[_FIELDS[key]] = int(value) / 1024
    missing = set(_FIELDS.values()) - set(found)
    if missing:
        raise ValueError(f"/proc status lacks {sorted(missing)} (not Linux >= 4.5?)")
    return MemoryFigures(**found)
