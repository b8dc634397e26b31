"""TLS and basic auth for the metrics endpoint, both optional (monitor.exporter.serve).

TLS is prometheus-client's own way (its `start_wsgi_server(certfile=, keyfile=, client_cafile=,
client_auth_required=)`): a server-side `ssl.SSLContext` wrapping the listening socket, here around
our WSGI app because it also answers /healthz and /readyz. prometheus-client (0.26) has no basic
auth for serving, so a small WSGI wrapper checks it: user and password from a file, never a flag,
compared in constant time. /healthz and /readyz stay open (they say only "ok" or "not ready") so
probes need no secret; /metrics asks for the password.

The matching Prometheus scrape job: `scheme: https`, `tls_config: {ca_file: ...}`,
`basic_auth: {username: ..., password_file: ...}`.
"""

from __future__ import annotations

import base64
import hmac
import ssl
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MetricsSecurity", "server_context", "require_basic_auth", "read_credentials"]

OPEN_PATHS = ("/healthz", "/readyz")


@dataclass(frozen=True)
class MetricsSecurity:
    """Where the endpoint's certificate, key, client CA and credentials are; never a secret itself."""

    cert_file: str | None = None  # PEM certificate chain: serve HTTPS
    key_file: str | None = None  # its private key (PEM)
    client_ca_file: str | None = None  # require client certificates signed by this CA (mutual TLS)
    auth_file: str | None = None  # basic auth: a file whose first line is USER:PASSWORD

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("metrics TLS needs both --metrics-tls-cert and --metrics-tls-key")
        if self.client_ca_file and not self.cert_file:
            raise ValueError("--metrics-tls-client-ca needs --metrics-tls-cert and --metrics-tls-key")

    @property
    def tls(self) -> bool:
        return bool(self.cert_file)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"


def server_context(security: MetricsSecurity) -> ssl.SSLContext:
    """The server context prometheus-client builds for its TLS endpoint, TLS 1.2 at least.

    One-line ValueError when a file cannot be loaded."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(certfile=security.cert_file, keyfile=security.key_file)
        if security.client_ca_file:
            context.load_verify_locations(cafile=security.client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"metrics TLS: cannot load {security.cert_file}, {security.key_file}"
                         f"{', ' + security.client_ca_file if security.client_ca_file else ''}: {exc}") from None
    return context


def read_credentials(path: str) -> tuple[str, str]:
    """(user, password) from the first line `USER:PASSWORD` of `path`; one-line ValueError otherwise."""
    try:
        lines = Path(path).expanduser().read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read the metrics auth file {path}: {exc.strerror}") from None
    user, colon, password = (lines[0] if lines else "").partition(":")
    if not user or not colon or not password:
        raise ValueError(f"the metrics auth file {path} must hold one line USER:PASSWORD")
    return user, password


def require_basic_auth(app, user: str, password: str, realm: str = "streamer"):
    """`app` behind HTTP basic auth, except OPEN_PATHS; 401 with a challenge otherwise."""
    expected = base64.b64encode(f"{user}:{password}".encode()).decode()

    def guarded(environ, start_response):
        if (environ.get("PATH_INFO") or "/") in OPEN_PATHS:
            return app(environ, start_response)
        given = environ.get("HTTP_AUTHORIZATION", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "basic" and hmac.compare_digest(token.strip().encode(), expected.encode()):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                            ("WWW-Authenticate", f'Basic realm="{realm}", charset="UTF-8"')])
        return [b"unauthorized\n"]

    return guarded
