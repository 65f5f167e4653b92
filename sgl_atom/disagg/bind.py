"""Where the atom P/D control plane listens: the address of ``--host`` unless told otherwise.

SGLang's KV manager binds its per-rank control socket to ``get_local_ip_auto()`` (the machine's
network address unless ``SGLANG_HOST_IP`` is set), and UCX opens its TCP listeners on every
network device unless ``UCX_NET_DEVICES`` names some. A server started with ``--host
127.0.0.1`` would then accept unauthenticated control frames on the network. So, before the
manager binds, a server whose ``--host`` is one specific address gets that address as
``SGLANG_HOST_IP`` and, when it is a loopback address, ``UCX_NET_DEVICES=lo``. A wildcard
``--host`` (``0.0.0.0``, ``::``) keeps SGLang's choice. Either variable set by the user wins:
that is how a P/D pair across hosts exposes the control plane on purpose.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import MutableMapping

WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def control_plane_address(
    server_host: str | None, environ: MutableMapping[str, str] = os.environ
) -> str | None:
    """Set the bind defaults in ``environ`` from ``--host``; return the control address (None:
    SGLang's own choice, for a wildcard host)."""
    if environ.get("SGLANG_HOST_IP"):
        return environ["SGLANG_HOST_IP"]
    if server_host is None or server_host in WILDCARDS:
        return None
    try:
        ip = socket.gethostbyname(server_host.strip("[]"))
    except OSError as e:
        raise ValueError(
            f"atom P/D: cannot resolve --host {server_host!r} for the control plane ({e}); pass "
            "an IP address, or set SGLANG_HOST_IP to the address the control socket should bind"
        ) from e
    environ["SGLANG_HOST_IP"] = ip
    if ipaddress.ip_address(ip).is_loopback:
        environ.setdefault("UCX_NET_DEVICES", "lo")
    return ip
