"""The Redis URLs celery-agents takes beyond redis-py's own (`redis://`, `rediss://`, `unix://`):
`redis+sentinel://` and `redis+cluster://` (`rediss+…` for TLS), parsed into what they name, or
refused with a `ValueError` that says what is wrong and the form. Plain text handling only: the
settings check the URLs with it before any client is made (config.py), and store/connection.py
makes the clients."""

from __future__ import annotations

import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SENTINEL_FORM = "redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…]/MASTER[/DB] (rediss+sentinel:// for TLS)"
SENTINEL_PORT = 26379
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
CLUSTER_FORM = "redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT…] (rediss+cluster:// for TLS)"

_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
_SSL_OPTIONS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
_SENTINEL_AUTH = ("sentinel_username", "sentinel_password")


#: a URL's user and password: all from `//` to its last `@` before the query (a password may
#: hold `@` or `/`, written unescaped)
_USERINFO = re.compile(r"//[^?#]*@")
#: a password given as a query option (`?sentinel_password=…`)
_QUERY_SECRET = re.compile(r"([?&][a-z_]*password=)[^&#]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """`url` with its user, password and any password option shown as `***`, for messages."""
    return _QUERY_SECRET.sub(r"\1***", _USERINFO.sub("//***@", url))


@dataclass(frozen=True)
class SentinelUrl:
    """What a `redis+sentinel://` URL names."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    #: TLS options of the query (`ssl_cert_reqs` as an `ssl` constant), for masters and sentinels
    ssl_options: dict[str, Any] = field(default_factory=dict)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class ClusterUrl:
    """What a `redis+cluster://` URL names: nodes to learn the cluster from."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    ssl_options: dict[str, Any] = field(default_factory=dict)


def is_cluster_url(url: str | None) -> bool:
    return bool(url) and str(url).split("://", 1)[0].lower() in CLUSTER_SCHEMES


def parse_cluster_url(url: str) -> ClusterUrl:
    """The parts of a `redis+cluster://` URL; ValueError naming what is wrong and the form."""

    def bad(why: str) -> ValueError:
        return ValueError(f"invalid Cluster URL: {why}; the form is {CLUSTER_FORM}")

    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in CLUSTER_SCHEMES:
        raise bad(f"{scheme or url!r} is not a Cluster URL scheme")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    if path.strip("/") not in ("", "0"):
        raise bad(f"a Cluster has database 0 only, not {path!r}")
    credentials, at, hosts = netloc.rpartition("@")
    username, password = _credentials(credentials) if at else (None, None)
    nodes = tuple(_host(h, 6379, bad) for h in hosts.split(",") if h.strip())
    if not nodes:
        raise bad("no HOST:PORT")
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(options) - set(_SSL_OPTIONS))
    if unknown:
        raise bad(f"unknown option {', '.join(unknown)} (known: {', '.join(_SSL_OPTIONS)})")
    return ClusterUrl(
        nodes=nodes,
        username=username,
        password=password,
        tls=scheme.lower() == "rediss+cluster",
        ssl_options=_ssl_options(options, bad),
    )


def is_sentinel_url(url: str | None) -> bool:
    return bool(url) and str(url).split("://", 1)[0].lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelUrl:
    """The parts of a `redis+sentinel://` URL; ValueError naming what is wrong and the form."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SENTINEL_SCHEMES:
        raise _bad(f"{scheme or url!r} is not a Sentinel URL scheme")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    credentials, at, hosts = netloc.rpartition("@")
    username, password = _credentials(credentials) if at else (None, None)
    sentinels = tuple(_host(h) for h in hosts.split(",") if h.strip())
    if not sentinels:
        raise _bad("no sentinel HOST:PORT")
    parts = [p for p in path.split("/") if p]
    if not parts:
        raise _bad("no MASTER (the name the sentinels monitor the primary by)")
    if len(parts) > 2:
        raise _bad(f"the path {path!r} is more than MASTER/DB")
    db = parts[1] if len(parts) == 2 else "0"
    if not db.isdigit():
        raise _bad(f"DB {db!r} is not a database number")
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(options) - set(_SSL_OPTIONS) - set(_SENTINEL_AUTH))
    if unknown:
        raise _bad(f"unknown option {', '.join(unknown)} (known: {', '.join(_SSL_OPTIONS + _SENTINEL_AUTH)})")
    return SentinelUrl(
        sentinels=sentinels,
        master=unquote(parts[0]),
        db=int(db),
        username=username,
        password=password,
        tls=scheme.lower() == "rediss+sentinel",
        ssl_options=_ssl_options(options),
        sentinel_username=options.get("sentinel_username"),
        sentinel_password=options.get("sentinel_password"),
    )


def _bad(why: str) -> ValueError:
    return ValueError(f"invalid Sentinel URL: {why}; the form is {SENTINEL_FORM}")


def _credentials(text: str) -> tuple[str | None, str | None]:
    user, colon, password = text.partition(":")
    return (unquote(user) or None), (unquote(password) if colon else None)


def _host(text: str, default_port: int = SENTINEL_PORT, bad: Callable[[str], ValueError] = _bad) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):  # [IPv6]:PORT
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = text.partition(":")
    if not host:
        raise bad(f"no HOST in {text!r}")
    if port and not port.isdigit():
        raise bad(f"{port!r} is not a port")
    return host, int(port) if port else default_port


def _ssl_options(options: dict[str, str], bad: Callable[[str], ValueError] = _bad) -> dict[str, Any]:
    out: dict[str, Any] = {k: v for k, v in options.items() if k in _SSL_OPTIONS}
    if "ssl_cert_reqs" in out:
        reqs = out["ssl_cert_reqs"].lower()
        if reqs not in _CERT_REQS:
            raise bad(f"ssl_cert_reqs={reqs!r} is none of {', '.join(_CERT_REQS)}")
        out["ssl_cert_reqs"] = _CERT_REQS[reqs]
    return out
