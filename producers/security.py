"""How a Kafka client authenticates and encrypts: one frozen config for every client.

`KafkaSecurity` holds no secret. It names where the password is (an environment variable or a
file), because configs are written to config.json and into checkpoints. The composition root
(streamer/settings.py reads the environment) resolves the password once and calls
`client_kwargs(password)`, whose dict goes to every aiokafka client alike: producer, learner
consumer, dead-letter producer and admin client.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aiokafka.errors import (AuthenticationFailedError, AuthenticationMethodNotSupported, SaslAuthenticationFailed,
                             UnsupportedSaslMechanismError)

__all__ = ["KafkaSecurity", "PROTOCOLS", "MECHANISMS", "read_password_file", "AUTH_ERRORS", "is_refusal",
           "authentication_failed", "no_answer", "refusal_reason"]

# What aiokafka raises when the broker refuses the credentials or the mechanism.
AUTH_ERRORS = (AuthenticationFailedError, AuthenticationMethodNotSupported, SaslAuthenticationFailed,
               UnsupportedSaslMechanismError)
PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


@dataclass(frozen=True)
class KafkaSecurity:
    """Kafka's `security.protocol`, `sasl.mechanism` and TLS files, minus the secret.

    `password_env` or `password_file` says where the SASL password is; never the password."""

    protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None  # SASL_*: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (default SCRAM-SHA-512)
    username: str | None = None
    password_env: str | None = None  # the environment variable holding the password
    password_file: str | None = None  # a file whose first line is the password
    ca_file: str | None = None  # SSL/SASL_SSL: the CA bundle to verify the broker (default: the system's)
    cert_file: str | None = None  # SSL/SASL_SSL: a client certificate (mutual TLS), with key_file
    key_file: str | None = None

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"Kafka security protocol {self.protocol!r} is not one of {', '.join(PROTOCOLS)}")
        if self.sasl_mechanism is not None and self.sasl_mechanism not in MECHANISMS:
            raise ValueError(f"SASL mechanism {self.sasl_mechanism!r} is not one of {', '.join(MECHANISMS)}")
        if self.sasl:
            if not self.username:
                raise ValueError(f"{self.protocol} needs a username (--sasl-username)")
            if bool(self.password_env) == bool(self.password_file):
                raise ValueError(f"{self.protocol} needs the password from exactly one of "
                                 "--sasl-password-env VARIABLE or --sasl-password-file FILE")
        elif self.sasl_mechanism or self.username or self.password_env or self.password_file:
            raise ValueError(f"SASL options need --security-protocol SASL_PLAINTEXT or SASL_SSL "
                             f"(not {self.protocol})")
        if not self.tls and (self.ca_file or self.cert_file or self.key_file):
            raise ValueError(f"TLS files need --security-protocol SSL or SASL_SSL (not {self.protocol})")
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("a client certificate needs both --ssl-cert and --ssl-key")

    @property
    def sasl(self) -> bool:
        return self.protocol.startswith("SASL_")

    @property
    def tls(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")

    @property
    def mechanism(self) -> str | None:
        return (self.sasl_mechanism or "SCRAM-SHA-512") if self.sasl else None

    def describe(self) -> str:
        """One line for logs: what is used, never the password."""
        parts = [self.protocol]
        if self.sasl:
            parts.append(f"{self.mechanism} as {self.username}")
        if self.tls:
            parts.append(f"CA {self.ca_file or 'system'}" + (", client certificate" if self.cert_file else ""))
        return ", ".join(parts)

    def client_kwargs(self, password: str | None = None) -> dict:
        """aiokafka client keyword arguments (the same for producers, consumers and admin clients).

        `password`: the resolved SASL password (the caller read it from password_env or password_file)."""
        kwargs: dict = {"security_protocol": self.protocol}
        if self.tls:
            from aiokafka.helpers import create_ssl_context

            for label, path in (("CA file", self.ca_file), ("certificate", self.cert_file), ("key", self.key_file)):
                if path and not Path(path).is_file():
                    raise ValueError(f"Kafka TLS {label} {path} does not exist")
            try:
                kwargs["ssl_context"] = create_ssl_context(cafile=self.ca_file, certfile=self.cert_file,
                                                           keyfile=self.key_file)
            except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                raise ValueError(f"Kafka TLS files cannot be loaded: {exc}") from None
        if self.sasl:
            if not password:
                raise ValueError(f"no SASL password for {self.username}: {self.password_source} is empty")
            kwargs.update(sasl_mechanism=self.mechanism, sasl_plain_username=self.username,
                          sasl_plain_password=password)
        return kwargs

    @property
    def password_source(self) -> str:
        if self.password_env:
            return f"environment variable {self.password_env}"
        return f"file {self.password_file}"


def read_password_file(path: str) -> str:
    """The first line of `path`, without its line end; a one-line ValueError when it cannot be read."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the SASL password file {path}: {exc.strerror}") from None
    lines = text.splitlines()
    return lines[0] if lines else ""


def is_refusal(exc: BaseException, options: dict | None) -> bool:
    """Whether a client's start() failed because the broker refused the credentials or the mechanism.

    aiokafka 0.14's SCRAM client raises KeyError('v') when the server's final message is an error
    (RFC 5802 e=unknown-user, e=invalid-proof) instead of a verifier; with SASL configured, a KeyError
    from start() is that refusal."""
    sasl = bool(options and options.get("sasl_mechanism"))
    return isinstance(exc, AUTH_ERRORS) or (sasl and isinstance(exc, KeyError))


def authentication_failed(bootstrap_servers: str, security: KafkaSecurity | None, exc: Exception) -> str:
    """The one line for a broker that refused to authenticate us (never the password)."""
    if security is not None and security.sasl:
        hint = f"check --sasl-username and the password in {security.password_source}"
    else:
        hint = "the broker asks for authentication: see --security-protocol and --sasl-mechanism"
    how = security.describe() if security else "PLAINTEXT"
    return f"Kafka at {bootstrap_servers} refused the connection ({how}): {refusal_reason(exc)}; {hint}"


def no_answer(bootstrap_servers: str, timeout_s: float, options: dict | None) -> str:
    """The one line for a broker that did not answer for `timeout_s`. aiokafka takes a listener that does not
    take the client's security protocol or SASL mechanism (SASL to a plaintext port: UnsupportedSaslMechanism)
    for one that does not answer, so a client with security (`options`, aiokafka's keyword arguments) is told
    to check it."""
    line = f"cannot reach Kafka at {bootstrap_servers} (no answer for {timeout_s:g} s; --broker-timeout)"
    protocol = (options or {}).get("security_protocol", "PLAINTEXT")
    if protocol != "PLAINTEXT":
        flags = "--security-protocol, --sasl-mechanism" if protocol.startswith("SASL") else "--security-protocol"
        line += f"; or its listener there does not take {protocol}: check {flags} and the port"
    return line


def refusal_reason(exc: BaseException) -> str:
    """What refused us, in words: aiokafka's SCRAM KeyError (see is_refusal) is a failed SCRAM exchange."""
    return "SCRAM authentication failed" if isinstance(exc, KeyError) else type(exc).__name__
