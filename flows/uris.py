"""Rules of the URIs and URLs the service is given: no credentials in a URI, and where a webhook may point.

The bottom of the ``flows`` layers (docs/architecture.md): the configuration checks them when the file is
loaded (`flows.config`), a flow called directly checks its parameters (`flows.runtime.guard`) and the
notifier checks a webhook again against its resolved addresses when it sends (`flows.integrations.notify`).
"""
from __future__ import annotations

import ipaddress
import re
import socket
from typing import Any
from urllib.parse import urlsplit

from cje_engine.errors import CJEInputError

__all__ = ["CREDENTIALS_HINT", "WEBHOOK_SCHEMES", "check_uri", "check_webhook_url", "forbidden_address", "literal_ip"]

CREDENTIALS_HINT = ("credentials never go in a URI (Prefect stores flow parameters and logs them); set "
                    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or an instance role) in the "
                    "environment of `cje`, see docs/failure-modes.md")


def check_uri(uri: str, what: str = "URI") -> str:
    """Refuse a URI carrying credentials (user-info or a password-like query); return it.

    The message never repeats the URI's secret part.
    """
    if "://" not in uri:
        return uri
    parts = urlsplit(uri)
    if "@" in parts.netloc or parts.username is not None or parts.password is not None:
        host = parts.netloc.rsplit("@", 1)[-1]
        raise CJEInputError(f"{what} {parts.scheme}://***@{host}{parts.path} has credentials in it; "
                            + CREDENTIALS_HINT)
    if re.search(r"(?i)(secret|password|token|access[_-]?key|signature)=", parts.query):
        raise CJEInputError(f"{what} {parts.scheme}://{parts.netloc}{parts.path}?*** has credentials in its "
                            "query; " + CREDENTIALS_HINT)
    return uri


#: Schemes a webhook may use.
WEBHOOK_SCHEMES = ("http", "https")
#: Cloud metadata endpoints (beside every link-local address, which is refused as a whole).
_METADATA_IPS = frozenset({ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254"),
                           ipaddress.ip_address("100.100.100.200")})
_METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata.goog", "instance-data",
                             "instance-data.ec2.internal"})


def literal_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address a host written as an IP literal stands for (also the legacy IPv4 forms a resolver
    accepts: ``2852039166``, ``0xa9fea9fe``, ``169.254.43518``); None for a name."""
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        pass
    if re.fullmatch(r"[0-9a-fA-FxX.]+", host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


def forbidden_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why a webhook may not target ``ip`` (link-local or a cloud metadata address), or None."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip in _METADATA_IPS:
        return "a cloud metadata address"
    if ip.is_link_local:
        return "a link-local address (169.254.0.0/16, fe80::/10)"
    return None


def check_webhook_url(url: Any, what: str = "webhook_url") -> str:
    """A webhook URL the service may POST to; `CJEInputError` naming ``what`` otherwise.

    Only ``http``/``https`` with a host; never a link-local address (169.254.0.0/16, fe80::/10) or a
    cloud metadata endpoint (169.254.169.254, fd00:ec2::254, ``metadata.google.internal``), written
    in any form an address resolver accepts; no credentials in user-info.  Loopback is allowed (a
    receiver beside the service).  Host names are checked again against their resolved addresses
    when a message is sent (`flows.integrations.notify`).
    """
    if not isinstance(url, str) or not url.strip():
        raise CJEInputError(f"{what} must be a non-empty http:// or https:// URL, got {url!r}")
    try:
        parts = urlsplit(url.strip())
        host = parts.hostname or ""
    except ValueError:
        raise CJEInputError(f"{what} is not a valid URL") from None
    shown = f"{parts.scheme}://{host or ''}" if parts.scheme else repr(url.split("?", 1)[0][:60])
    if parts.scheme.lower() not in WEBHOOK_SCHEMES:
        raise CJEInputError(f"{what} {shown} must be an http:// or https:// URL (scheme {parts.scheme or 'none'!r} "
                            "is refused)")
    if not host:
        raise CJEInputError(f"{what} {shown} has no host")
    check_uri(url.strip().split("?", 1)[0], what)
    if host.lower().rstrip(".") in _METADATA_HOSTS:
        raise CJEInputError(f"{what} {shown} targets a cloud metadata service; refused")
    ip = literal_ip(host)
    why = forbidden_address(ip) if ip is not None else None
    if why:
        raise CJEInputError(f"{what} {shown} targets {why}; refused")
    return url
