"""Who may call the administrative routes: root, or a peer in the configured admin group.

The peer's uid and gid come from the kernel (SO_PEERCRED, taken when it connected), so they cannot
be forged by the client; group membership is looked up in the system's group database.
"""

from __future__ import annotations

import grp
import os
import pwd

from .errors import Forbidden


def is_admin(peer: tuple[int, int, int] | None, admin_group: str) -> bool:
    if peer is None:
        return False
    _, uid, gid = peer
    if uid == 0:
        return True
    if not admin_group:
        return False
    try:
        group = grp.getgrnam(admin_group)
    except KeyError:
        return False
    if gid == group.gr_gid:
        return True
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return False
    return user.pw_name in group.gr_mem or group.gr_gid in os.getgrouplist(user.pw_name, user.pw_gid)


def require_admin(peer: tuple[int, int, int] | None, admin_group: str) -> None:
    if not is_admin(peer, admin_group):
        who = "an unknown peer" if peer is None else f"uid {peer[1]}"
        group = f"in group {admin_group!r}" if admin_group else "(no admin group is configured)"
        raise Forbidden(f"administrative call refused for {who}: only root or members {group} may do this")
