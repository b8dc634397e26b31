"""The Kafka security flag group of learn, produce, demo and compare, and the KafkaSecurity it makes.

    --security-protocol SASL_SSL --sasl-mechanism SCRAM-SHA-512 --sasl-username learner
    --sasl-password-env STREAMER_KAFKA_PASSWORD   (or --sasl-password-file FILE)
    --ssl-cafile ca.pem [--ssl-cert client.pem --ssl-key client.key]

The password is never a flag value (it would show in `ps` and in config.json): a flag names the
environment variable or the file that holds it. In a --config TOML file the same keys are
top-level (`security_protocol = "SASL_SSL"`, `sasl_password_env = "KAFKA_PASSWORD"`, ...).
"""

from __future__ import annotations

from pathlib import Path

from monitor.web_security import MetricsSecurity, read_credentials, server_context
from producers.security import MECHANISMS, PROTOCOLS, KafkaSecurity
from streamer.cli.errors import UserError

__all__ = ["add_security_flags", "add_metrics_security_flags", "kafka_security", "metrics_security",
           "client_options", "DEFAULT_PASSWORD_ENV"]

DEFAULT_PASSWORD_ENV = "STREAMER_KAFKA_PASSWORD"  # where a SASL password is read when no flag names a source


def add_security_flags(p) -> None:
    group = p.add_argument_group("Kafka security (see SECURITY.md)")
    group.add_argument("--security-protocol", choices=PROTOCOLS, default="PLAINTEXT",
                       help="how to reach Kafka: TLS (SSL), SASL authentication, or both (default %(default)s)")
    group.add_argument("--sasl-mechanism", choices=MECHANISMS, default=None,
                       help="SASL mechanism with SASL_* protocols (default SCRAM-SHA-512)")
    group.add_argument("--sasl-username", default=None, metavar="USER", help="SASL user name (default: none)")
    group.add_argument("--sasl-password-env", default=None, metavar="VARIABLE",
                       help=f"environment variable holding the SASL password (default {DEFAULT_PASSWORD_ENV}); "
                            "never the password itself")
    group.add_argument("--sasl-password-file", default=None, metavar="FILE",
                       help="file whose first line is the SASL password, instead of a variable (default: none)")
    group.add_argument("--ssl-cafile", default=None, metavar="FILE",
                       help="CA certificates (PEM) that sign the broker's certificate (default: the system's)")
    group.add_argument("--ssl-cert", default=None, metavar="FILE",
                       help="client certificate (PEM) for brokers that require mutual TLS (default: none)")
    group.add_argument("--ssl-key", default=None, metavar="FILE",
                       help="private key (PEM) of --ssl-cert (default: none)")


def kafka_security(args) -> KafkaSecurity:
    """The KafkaSecurity of the flags, checked now: the password is there and the TLS files load.

    A one-line UserError otherwise, before anything starts."""
    sasl = args.security_protocol.startswith("SASL_")
    password_env = args.sasl_password_env
    if sasl and not password_env and not args.sasl_password_file:
        password_env = DEFAULT_PASSWORD_ENV
    try:
        security = KafkaSecurity(protocol=args.security_protocol, sasl_mechanism=args.sasl_mechanism,
                                 username=args.sasl_username, password_env=password_env,
                                 password_file=args.sasl_password_file, ca_file=args.ssl_cafile,
                                 cert_file=args.ssl_cert, key_file=args.ssl_key)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    client_options(security)  # the password and the TLS files, checked before anything starts
    return security


def client_options(security: KafkaSecurity) -> dict:
    """aiokafka's keyword arguments of `security`, the password resolved; UserError when it is missing."""
    from streamer.settings import kafka_client_options

    try:
        return kafka_client_options(security)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def add_metrics_security_flags(p) -> None:
    group = p.add_argument_group("metrics endpoint security (see SECURITY.md)")
    group.add_argument("--metrics-tls-cert", default=None, metavar="FILE",
                       help="serve the metrics endpoint over HTTPS with this certificate (PEM; default: plain HTTP)")
    group.add_argument("--metrics-tls-key", default=None, metavar="FILE",
                       help="private key (PEM) of --metrics-tls-cert (default: none)")
    group.add_argument("--metrics-tls-client-ca", default=None, metavar="FILE",
                       help="require scrapers to present a certificate signed by this CA (default: not required)")
    group.add_argument("--metrics-auth-file", default=None, metavar="FILE",
                       help="basic auth on /metrics: a file whose first line is USER:PASSWORD (default: none; "
                            "/healthz and /readyz stay open)")


def metrics_security(args) -> MetricsSecurity:
    """The MetricsSecurity of the flags, its files loaded once now: a one-line UserError when one cannot be."""
    def absolute(path: str | None) -> str | None:  # config.json names them for `streamer status` run anywhere
        return None if path is None else str(Path(path).expanduser().absolute())

    try:
        security = MetricsSecurity(cert_file=absolute(args.metrics_tls_cert), key_file=absolute(args.metrics_tls_key),
                                   client_ca_file=absolute(args.metrics_tls_client_ca),
                                   auth_file=absolute(args.metrics_auth_file))
        if security.tls:
            server_context(security)
        if security.auth_file:
            read_credentials(security.auth_file)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return security
