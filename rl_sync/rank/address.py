"""The address a rank binds, from a network interface's name (`SyncConfig.interface`).

Typical use::

    interface_address("eth1")   # '10.0.3.7', in this process's network namespace
"""

from __future__ import annotations

import fcntl
import socket
import struct

_SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str:
    """The IPv4 address of interface `name` on this host, or `ValueError` naming the interfaces
    there are."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            names = ", ".join(sorted(n for _, n in socket.if_nameindex()))
            raise ValueError(
                f"SyncConfig.interface {name!r} has no IPv4 address on {socket.gethostname()} "
                f"({exc.strerror}); interfaces here: {names}"
            ) from None
    return socket.inet_ntoa(packed[20:24])
