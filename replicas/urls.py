"""What a replica URL may be, and its one canonical spelling: the replica's identity.

A replica is ``http://host:port`` or ``https://host:port`` (a path prefix is allowed, a
query or fragment is not): a host name or an IP address (IPv6 in brackets), an explicit
or default port in 1..65535, no user info, no whitespace or control characters. Anything
else is refused with a reason, at start-up (a bad ``--replica`` is a clear error, not a
replica that stays ``joining`` forever) and by ``POST /admin/replicas`` (a 400).

Why a canonical form: the registry keys replicas by their id, so before this module
canonicalized, ``HTTP://127.0.0.1:30000``, ``http://0.0.0.0:30000`` and
``http://0x7f000001:30000`` became three "replicas" that were one process (issue 41,
item 7): its load was split three ways and routing thought it had three caches. Now
every spelling that reaches the same socket without a DNS lookup is one id:

- scheme and host name are lower-cased (both are case-insensitive);
- a default port (80 for http, 443 for https) is dropped, as the WHATWG URL standard
  does, so ``http://r:80`` and ``http://r`` are one id;
- an IPv4 address in any form ``inet_aton`` (hence the resolver, hence every HTTP
  client) accepts is written dotted-decimal: ``0x7f000001``, ``2130706433``, ``127.1``,
  ``0177.0.0.1``. A host whose last label is numeric is an IPv4 address or is refused
  (as WHATWG does), so ``1.2.3.999`` cannot slip through as a "host name";
- IPv6 is written compressed and lower-case (``[fd00:0::1]`` -> ``[fd00::1]``), and an
  IPv4-mapped address (``[::ffff:127.0.0.1]``) is written as its IPv4 address;
- an unspecified address is written as the loopback address of its family
  (``0.0.0.0`` -> ``127.0.0.1``, ``[::]`` -> ``[::1]``): connecting to it on Linux and
  macOS reaches the local host, so that *is* the replica it names, and SGLang's own
  start-up line prints ``http://0.0.0.0:30000``, so operators paste it. Mapping keeps
  those configurations working while naming the one replica they reach; refusing
  would break them for no safety gain (loopback is allowed anyway);
- trailing slashes of the path are dropped. A host name's trailing dot is kept: with
  resolver search domains ``r`` and ``r.`` can name different hosts.

Not merged: names with addresses (``localhost`` vs ``127.0.0.1``; the gateway never
resolves names here), and distinct loopback addresses (``127.0.0.2`` is another socket).

Refused unless ``registry.allow_link_local_replicas``: link-local addresses
(169.254.0.0/16, fe80::/10, also IPv4-mapped or behind the NAT64 prefix 64:ff9b::/96)
and the cloud metadata services below, by address and by name. A replica gets every
prompt and answers to clients, and the metadata service hands out cloud credentials: an
admin-token holder (or a bad config line) must not be able to point the gateway at it.
The name list is the well-known names, not a guarantee: a name that *resolves* to a
metadata address is not caught (no DNS at parse time); block it in the network too.
"""
from __future__ import annotations

import ipaddress
import re
from typing import TypeAlias
from urllib.parse import urlsplit

from prefix_index.base import ReplicaId

_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")
_CONTROL = re.compile(r"[\x00-\x20\x7f]")
_NUMERIC_LABEL = re.compile(r"^(0[xX][0-9A-Fa-f]*|[0-9]+)$")
_HEX_PART = re.compile(r"^0[xX][0-9A-Fa-f]+$")
_OCT_PART = re.compile(r"^0[0-7]*$")
_DEC_PART = re.compile(r"^[1-9][0-9]*$")
MAX_URL_CHARS = 2048
DEFAULT_PORTS = {"http": 80, "https": 443}

METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254",  # AWS, GCP, Azure, OpenStack, Oracle, DigitalOcean... IMDS
    "169.254.170.2",    # AWS ECS task metadata / credentials
    "fd00:ec2::254",    # AWS IMDS over IPv6 (a ULA, not link-local: listed by address)
    "100.100.100.200",  # Alibaba Cloud metadata (in the CGNAT range: listed by address)
))
"""Cloud metadata service addresses refused as replicas (see the module doc)."""

METADATA_NAMES = frozenset((
    "metadata",                  # GCE's short name (search domain google.internal)
    "metadata.google.internal",  # GCE
    "metadata.goog",             # GCE alias
    "instance-data",             # AWS EC2 (search domain ec2.internal)
    "instance-data.ec2.internal",
    "metadata.azure.com",        # Azure name used by some SDKs for IMDS
    "metadata.tencentyun.com",   # Tencent Cloud
))
"""Host names of cloud metadata services refused as replicas (lower case, no trailing dot)."""

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
IPAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address


class ReplicaUrlError(ValueError):
    """Why a string is not a usable replica URL."""


def inet_aton(host: str) -> ipaddress.IPv4Address | None:
    """``host`` read as the C library's ``inet_aton`` reads it, or None if it is not.

    One to four parts, each decimal, ``0x`` hex or ``0`` octal; the last part fills the
    bytes the others left (``127.1`` is 127.0.0.1, ``0x7f000001`` one 32-bit part).
    Written out rather than ``socket.inet_aton`` because that one differs by platform
    (glibc also accepts trailing text after a space) and the id must not."""
    parts = host.split(".")
    if not 1 <= len(parts) <= 4:
        return None
    values = [_aton_part(p) for p in parts]
    if any(v is None for v in values):
        return None
    nums = [v for v in values if v is not None]
    head, last = nums[:-1], nums[-1]
    if any(v > 255 for v in head) or last >= 256 ** (5 - len(nums)):
        return None
    value = 0
    for v in head:
        value = value << 8 | v
    return ipaddress.IPv4Address(value << 8 * (5 - len(nums)) | last)


def _aton_part(part: str) -> int | None:
    """One part of an ``inet_aton`` address: ``0x1f`` hex, ``017`` octal, ``15`` decimal.
    Matched by pattern first: ``int()`` alone would also take ``+1``, ``1_0`` or spaces."""
    if _HEX_PART.match(part):
        return int(part, base=16)  # int() takes the 0x prefix with base 16
    if _OCT_PART.match(part):
        return int(part, base=8)
    if _DEC_PART.match(part):
        return int(part, base=10)
    return None


def _canonical_ip(address: IPAddress) -> IPAddress:
    """The address a connection to ``address`` reaches, in one form: IPv4-mapped IPv6 as
    IPv4, an unspecified address as its family's loopback (see the module doc)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_unspecified:
        return ipaddress.IPv4Address("127.0.0.1") if address.version == 4 else ipaddress.IPv6Address("::1")
    return address


def _restricted_ip(address: IPAddress) -> str | None:
    """Why ``address`` needs ``allow_link_local_replicas``, or None."""
    if address in METADATA_ADDRESSES:
        return "a cloud metadata service address"
    if isinstance(address, ipaddress.IPv6Address) and address in _NAT64:
        embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        return None if _restricted_ip(embedded) is None else "a NAT64 form of a link-local or metadata address"
    if address.is_link_local:
        return "a link-local address"
    return None


def _ip_host(address: IPAddress) -> str:
    """An IP address as a URL host: IPv6 compressed in brackets (its zone kept)."""
    return f"[{address.compressed}]" if address.version == 6 else str(address)


def _parse_ipv6(host: str) -> IPAddress:
    if not host.endswith("]"):
        raise ReplicaUrlError(f"bad IPv6 address {host!r}")
    try:
        return ipaddress.IPv6Address(host[1:-1])
    except ValueError as exc:
        raise ReplicaUrlError(f"bad IPv6 address {host!r}") from exc


def _host_address(host: str) -> IPAddress | None:
    """The IP address ``host`` spells, None for a host name; ReplicaUrlError when it is
    neither (bad brackets, an all-numeric-ending name that is no IPv4 address)."""
    if host.startswith("["):
        return _parse_ipv6(host)
    bare = host.removesuffix(".")
    last = bare.rsplit(".", 1)[-1]
    if not _NUMERIC_LABEL.match(last):
        return None
    address = inet_aton(bare)
    if address is None:
        raise ReplicaUrlError(f"bad IPv4 address {host!r}")
    return address


def canonical_host(host: str, *, allow_link_local: bool = False) -> str:
    """The canonical URL host of ``host`` (module doc); ReplicaUrlError if it is not a
    usable replica host or is link-local / metadata and ``allow_link_local`` is False."""
    address = _host_address(host)
    if address is not None:
        address = _canonical_ip(address)
        why = _restricted_ip(address)
        if why is not None and not allow_link_local:
            raise ReplicaUrlError(f"{host!r} is {why}: refused unless registry.allow_link_local_replicas")
        return _ip_host(address)
    if not _HOSTNAME.match(host):
        raise ReplicaUrlError(f"bad host name {host!r}")
    name = host.lower()
    if name.rstrip(".") in METADATA_NAMES and not allow_link_local:
        raise ReplicaUrlError(f"{host!r} is a cloud metadata service name: "
                              "refused unless registry.allow_link_local_replicas")
    return name


def _path(path: str) -> str:
    """The path prefix without trailing slashes; dot segments are refused (clients differ
    on whether they resolve them, so they would make two ids of one URL)."""
    stripped = path.rstrip("/")
    if any(seg in (".", "..") for seg in stripped.split("/")):
        raise ReplicaUrlError(f"path {path!r}: no '.' or '..' segments")
    return stripped


def _checked_text(url: object) -> str:
    """``url`` stripped, if it is a non-empty string of sane length and characters."""
    if not isinstance(url, str) or not url.strip():
        raise ReplicaUrlError("a replica URL must be a non-empty string")
    text = url.strip()
    if len(text) > MAX_URL_CHARS:
        raise ReplicaUrlError(f"a replica URL is at most {MAX_URL_CHARS} characters")
    if _CONTROL.search(text):
        raise ReplicaUrlError("a replica URL must not contain whitespace or control characters")
    return text


def parse_replica_url(url: str, *, allow_link_local: bool = False) -> ReplicaId:
    """The canonical replica id of a valid URL (module doc); ReplicaUrlError otherwise.

    Every place that makes a replica id from a URL calls this (the config's static list,
    the admin API, discovery), so one replica is one registry entry whatever its spelling."""
    text = _checked_text(url)
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:  # "http://[::1" or a port out of range
        raise ReplicaUrlError(f"not a URL: {exc}") from exc
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise ReplicaUrlError(f"{text!r}: the scheme must be http:// or https://")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise ReplicaUrlError(f"{text!r}: user info is not allowed")
    if parts.query or parts.fragment or "?" in text or "#" in text:
        raise ReplicaUrlError(f"{text!r}: no query or fragment")
    netloc_host = parts.netloc.rsplit(":", 1)[0] if port is not None else parts.netloc
    if not netloc_host:
        raise ReplicaUrlError(f"{text!r}: a host is required")
    if (port is not None and not 0 < port < 65536) or (port is None and parts.netloc.endswith(":")):
        raise ReplicaUrlError(f"{text!r}: bad port")
    host = canonical_host(netloc_host, allow_link_local=allow_link_local)
    netloc = host if port in (None, DEFAULT_PORTS[scheme]) else f"{host}:{port}"
    return ReplicaId(f"{scheme}://{netloc}{_path(parts.path)}")


def address_replica_url(address: str, port: int, scheme: str = "http", *,
                        allow_link_local: bool = False) -> ReplicaId:
    """The canonical id of the replica at an IP ``address`` (DNS answers, EndpointSlice
    addresses): discovery goes through the same canonical form as the admin API, so a
    replica found both ways is one entry. ReplicaUrlError when refused."""
    host = f"[{address}]" if ":" in address else address
    return parse_replica_url(f"{scheme}://{host}:{port}", allow_link_local=allow_link_local)
