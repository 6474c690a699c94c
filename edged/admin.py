"""Who may call the administrative routes: root, the daemon's own user, or a peer in the
configured admin group.

The peer's uid, gid and supplementary groups come from the kernel (SO_PEERCRED and SO_PEERGROUPS,
taken when it connected), so the client cannot forge them. Where the kernel does not give the
groups, membership is looked up in the system's group database instead.
"""

from __future__ import annotations

import array
import grp
import os
import pwd
import socket
import struct
from dataclasses import dataclass

from .errors import Forbidden

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
"""Linux >= 4.13 (not every Python names it in its socket module)."""


@dataclass(frozen=True)
class Peer:
    uid: int
    gid: int
    groups: tuple[int, ...] | None
    """Supplementary group ids as the peer had them when it connected; None if unknown."""


def peer_of(sock: socket.socket) -> Peer | None:
    """The process at the other end of a Unix socket; None if unknown (then only
    non-administrative calls are allowed)."""
    if sock.family != socket.AF_UNIX:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    _pid, uid, gid = struct.unpack("3i", raw)
    return Peer(uid, gid, _peer_groups(sock))


def _peer_groups(sock: socket.socket) -> tuple[int, ...] | None:
    """None where unknown: an old kernel, or a peer in over 256 groups (Python's getsockopt takes
    at most 1,024 bytes, the kernel answers ERANGE); the group database is asked then."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)
    except OSError:
        return None
    return tuple(array.array("I", raw))


def is_admin(peer: Peer | None, admin_group: str) -> bool:
    if peer is None:
        return False
    if peer.uid in (0, os.geteuid()):  # root, or whoever runs this daemon (and owns its files anyway)
        return True
    if not admin_group:
        return False
    try:
        group = grp.getgrnam(admin_group)
    except KeyError:
        return False
    if peer.gid == group.gr_gid:
        return True
    if peer.groups is not None:  # the kernel's account, as systemd's SupplementaryGroups= sets it
        return group.gr_gid in peer.groups
    try:
        user = pwd.getpwuid(peer.uid)
    except KeyError:
        return False
    return user.pw_name in group.gr_mem or group.gr_gid in os.getgrouplist(user.pw_name, user.pw_gid)


def admin_group_missing(admin_group: str) -> bool:
    """Whether the configured admin group is not a group here: only root and the daemon's user
    may then make administrative calls."""
    if not admin_group:
        return False
    try:
        grp.getgrnam(admin_group)
    except KeyError:
        return True
    return False


def require_admin(peer: Peer | None, admin_group: str) -> None:
    if not is_admin(peer, admin_group):
        who = "an unknown peer" if peer is None else f"uid {peer.uid}"
        group = f"in group {admin_group!r}" if admin_group else "(no admin group is configured)"
        raise Forbidden(f"administrative call refused for {who}: only root, the daemon's user or "
                        f"members {group} may do this")
