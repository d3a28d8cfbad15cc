"""What a replica URL may be: one check for the command line, the config file and the admin API.

A replica is ``http://host:port`` or ``https://host:port`` (a path prefix is allowed, a
query or fragment is not): a host name or an IP address (IPv6 in brackets), an explicit
or default port in 1..65535, no user info, no whitespace or control characters. Anything
else is refused with a reason, at start-up (a bad ``--replica`` is a clear error, not a
replica that stays ``joining`` forever) and by ``POST /admin/replicas`` (a 400).
"""
from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from prefix_index.base import ReplicaId

_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")
_CONTROL = re.compile(r"[\x00-\x20\x7f]")
MAX_URL_CHARS = 2048


class ReplicaUrlError(ValueError):
    """Why a string is not a usable replica URL."""


def _check_host(host: str) -> None:
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1] if host.endswith("]") else "")
        except ValueError as exc:
            raise ReplicaUrlError(f"bad IPv6 address {host!r}") from exc
        return
    try:
        ipaddress.IPv4Address(host)
        return
    except ValueError:
        pass
    if all(label.isdigit() for label in host.rstrip(".").split(".")) or not _HOSTNAME.match(host):
        raise ReplicaUrlError(f"bad host name {host!r}")


def parse_replica_url(url: str) -> ReplicaId:
    """The normalized replica id (no trailing slash) of a valid URL; ReplicaUrlError otherwise."""
    if not isinstance(url, str) or not url.strip():
        raise ReplicaUrlError("a replica URL must be a non-empty string")
    text = url.strip()
    if len(text) > MAX_URL_CHARS:
        raise ReplicaUrlError(f"a replica URL is at most {MAX_URL_CHARS} characters")
    if _CONTROL.search(text):
        raise ReplicaUrlError("a replica URL must not contain whitespace or control characters")
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:  # "http://[::1" or a port out of range
        raise ReplicaUrlError(f"not a URL: {exc}") from exc
    if parts.scheme not in ("http", "https"):
        raise ReplicaUrlError(f"{text!r}: the scheme must be http:// or https://")
    if parts.username is not None or parts.password is not None:
        raise ReplicaUrlError(f"{text!r}: user info is not allowed")
    if parts.query or parts.fragment or "?" in text or "#" in text:
        raise ReplicaUrlError(f"{text!r}: no query or fragment")
    netloc_host = parts.netloc.rsplit(":", 1)[0] if port is not None else parts.netloc
    if not netloc_host:
        raise ReplicaUrlError(f"{text!r}: a host is required")
    _check_host(netloc_host)
    if (port is not None and not 0 < port < 65536) or (port is None and parts.netloc.endswith(":")):
        raise ReplicaUrlError(f"{text!r}: bad port")
    return ReplicaId(text.rstrip("/"))
