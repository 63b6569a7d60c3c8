"""The keyword arguments every aiokafka client gets: bootstrap servers and security.

TLS and SASL settings pass through untouched; anything else aiokafka accepts goes in
`ESK_KAFKA__EXTRA` as JSON. `check_access` tells, before the clients start, whether the
broker accepts those settings at all.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

from aiokafka.client import AIOKafkaClient
from aiokafka.conn import create_conn
from aiokafka.errors import (
    AuthenticationFailedError,
    KafkaConnectionError,
    KafkaError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
)
from aiokafka.helpers import create_ssl_context
from aiokafka.protocol.metadata import MetadataRequest

from ..settings import Settings


def _never_create_topics() -> None:
    """aiokafka's metadata requests let the broker create each topic they name (Metadata v4
    and later, `allow_auto_topic_creation`, which no client setting reaches). On a cluster
    that allows it (`auto.create.topics.enable`, Kafka's default), a processor or subscriber
    started before `esk topics init` would make the topics it reads with the broker's
    defaults: a partition count the changelog is not co-partitioned with, events deleted
    after a week. esk makes its topics itself, so its clients ask for none."""
    ask = MetadataRequest.__init__
    if getattr(ask, "esk_never_creates", False):
        return

    def never_creating(self: MetadataRequest, topics: list[str] | None = None, allow_auto_topic_creation: bool | None = None) -> None:
        ask(self, topics, False)

    never_creating.esk_never_creates = True  # type: ignore[attr-defined]
    MetadataRequest.__init__ = never_creating


_never_create_topics()


def _metadata_retries_backed_off() -> None:
    """aiokafka's producer, holding a batch for a partition whose leader it has lost (the
    broker gone), asks for metadata again the moment an update fails: with no broker to
    answer, thousands of refused connections a second, a core of CPU per process (both of
    a small host's cores for two APIs), for as long as the batch waits. A failed update is
    told to whoever waits for it only after the client's retry backoff (`retry_backoff_ms`,
    100 ms), as Kafka's Java client backs off; a successful one at once."""
    force = AIOKafkaClient.force_metadata_update
    if getattr(force, "esk_backs_off", False):
        return

    def backing_off(self: AIOKafkaClient) -> asyncio.Future[bool]:
        update: asyncio.Future[bool] = force(self)
        told: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        def tell(done: asyncio.Future[bool]) -> None:
            if told.done():
                return
            if done.cancelled():
                told.cancel()
            elif (error := done.exception()) is not None:
                told.set_exception(error)
            elif done.result():
                told.set_result(True)
            else:
                told.get_loop().call_later(self._retry_backoff, failed)

        def failed() -> None:
            if not told.done():
                told.set_result(False)

        update.add_done_callback(tell)
        return told

    backing_off.esk_backs_off = True  # type: ignore[attr-defined]
    AIOKafkaClient.force_metadata_update = backing_off


_metadata_retries_backed_off()


def client_options(settings: Settings) -> dict[str, Any]:
    kafka = settings.kafka
    options: dict[str, Any] = {
        "bootstrap_servers": settings.bootstrap_servers,
        "security_protocol": kafka.security_protocol,
        "request_timeout_ms": kafka.request_timeout_ms,
    }
    if kafka.security_protocol in ("SSL", "SASL_SSL"):
        context = create_ssl_context(
            cafile=kafka.ssl_cafile,
            certfile=kafka.ssl_certfile,
            keyfile=kafka.ssl_keyfile,
            # Not None: OpenSSL would ask for an encrypted key's password on the terminal
            password=kafka.ssl_password if kafka.ssl_password is not None else "",
        )
        context.check_hostname = kafka.ssl_check_hostname
        options["ssl_context"] = context
    if kafka.security_protocol.startswith("SASL"):
        for name in (
            "sasl_mechanism",
            "sasl_plain_username",
            "sasl_plain_password",
            "sasl_kerberos_service_name",
            "sasl_kerberos_domain_name",
        ):
            value = getattr(kafka, name)
            if value is not None:
                options[name] = value
    options.update(kafka.extra)
    return options


class KafkaAccessError(RuntimeError):
    """The broker refuses esk's clients (TLS, SASL): a one-line reason and what to set.
    No retry helps, and aiokafka's clients would only say "Unable to bootstrap"."""


async def check_access(settings: Settings) -> bool:
    """Connect to the first bootstrap server that answers as every client would, and raise
    KafkaAccessError when TLS or SASL refuses the connection. A broker that cannot be
    reached is no error here (each client reports that, or waits for it, as it does): the
    answer is whether one was."""
    kafka = settings.kafka
    mechanism = kafka.sasl_mechanism or "PLAIN"  # aiokafka's default
    # Every client would fail on them in aiokafka, with a traceback (`'NoneType' object has
    # no attribute 'encode'`)
    unset = [f"ESK_KAFKA__{name.upper()}" for name in ("sasl_plain_username", "sasl_plain_password") if getattr(kafka, name) is None]
    if kafka.security_protocol.startswith("SASL") and mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512") and unset:
        raise KafkaAccessError(f"ESK_KAFKA__SECURITY_PROTOCOL={kafka.security_protocol} with {mechanism} needs {' and '.join(unset)}, not set")
    try:
        options = client_options(settings)
    except (ssl.SSLError, OSError) as error:  # every client would fail so, with a traceback
        if not isinstance(error, ssl.SSLError):  # a file not there, or not readable (ssl names none)
            told = f"{error.strerror or error}" + (f": {error.filename}" if error.filename else "")
        else:  # Python's ssl says only "PEM lib" of a key it cannot decrypt or that is not the certificate's
            told = error.reason or "the client certificate and key do not load: a wrong password, or a key not the certificate's"
        raise KafkaAccessError(
            f"esk's TLS files could not be read ({told}): check ESK_KAFKA__SSL_CAFILE, ESK_KAFKA__SSL_CERTFILE, "
            "ESK_KAFKA__SSL_KEYFILE and ESK_KAFKA__SSL_PASSWORD (an encrypted key's password)"
        ) from None
    connection_options = {name: options[name] for name in _CONNECTION_OPTIONS if name in options}
    protocol = settings.kafka.security_protocol
    closed_in_handshake = []
    for address in settings.bootstrap_servers.split(","):
        host, _, port = address.strip().rpartition(":")
        where = f"Kafka at {host}:{port}"
        try:
            connection = await create_conn(host, int(port), **connection_options)
        except ssl.SSLCertVerificationError as error:
            raise KafkaAccessError(not_trusted(where, error)) from None
        except ssl.SSLError as error:
            raise KafkaAccessError(
                f"{where}: the TLS handshake failed ({error.reason or error}); "
                f"is ESK_KAFKA__SECURITY_PROTOCOL={protocol} what this listener speaks?"
            ) from None
        except (SaslAuthenticationFailed, AuthenticationFailedError, UnsupportedSaslMechanismError) as error:
            raise KafkaAccessError(
                f"{where} refused SASL authentication as {settings.kafka.sasl_plain_username!r} "
                f"({options.get('sasl_mechanism', 'PLAIN')}): {_detail(error)}; check ESK_KAFKA__SASL_MECHANISM, "
                "ESK_KAFKA__SASL_PLAIN_USERNAME and ESK_KAFKA__SASL_PLAIN_PASSWORD"
            ) from None
        except (ConnectionResetError, KafkaConnectionError) as error:
            if (refused := _client_certificate_refused(error)) is not None:
                given = settings.kafka.ssl_certfile
                raise KafkaAccessError(
                    f"{where} refused esk's TLS client certificate ({refused}): "
                    + (f"is {given} one its CAs issued?" if given else "it asks for one")
                    + "; ESK_KAFKA__SSL_CERTFILE and ESK_KAFKA__SSL_KEYFILE name it (ESK_KAFKA__SSL_PASSWORD an encrypted key's password)"
                ) from None
            # TLS spoken to a listener without it, or the other way round: the peer hangs
            # up. A broker shutting down does too, so this alone is no verdict.
            closed_in_handshake.append(address)
        except (OSError, TimeoutError, KafkaError):
            continue  # down, or not there: the next address, else the clients' own handling
        try:
            # A SASL listener answers ApiVersions, which the connection asked, before its
            # handshake, and hangs up at any other request of a client that skipped it.
            await connection.send(MetadataRequest([]))
        except (OSError, KafkaError):
            if not protocol.startswith("SASL"):
                raise KafkaAccessError(
                    f"{where} closed the connection at esk's first request: does its listener ask for SASL? "
                    f"ESK_KAFKA__SECURITY_PROTOCOL={protocol} leaves it out (SASL_{'SSL' if protocol == 'SSL' else 'PLAINTEXT'} "
                    "with ESK_KAFKA__SASL_MECHANISM, ESK_KAFKA__SASL_PLAIN_USERNAME and ESK_KAFKA__SASL_PLAIN_PASSWORD)"
                ) from None
            continue
        finally:
            connection.close()
        return True
    if closed_in_handshake:
        raise KafkaAccessError(
            f"Kafka at {', '.join(closed_in_handshake)} closed the connection during the handshake: "
            f"is ESK_KAFKA__SECURITY_PROTOCOL={protocol} what its listener speaks?"
        )
    return False


# The alerts a TLS server sends about the client's certificate (none, or one it does not trust).
_CLIENT_CERTIFICATE_ALERTS = ("CERTIFICATE_REQUIRED", "BAD_CERTIFICATE", "UNKNOWN_CA", "CERTIFICATE_UNKNOWN")


def _client_certificate_refused(error: BaseException) -> str | None:
    """The alert, when the connection ended because the broker refused the client's TLS
    certificate: with TLS 1.3 the client hears it only as the connection closes."""
    cause = error.__cause__ or error.__context__
    reason = cause.reason if isinstance(cause, ssl.SSLError) else None
    if reason and any(alert in reason for alert in _CLIENT_CERTIFICATE_ALERTS):
        return str(reason)
    return None


_CONNECTION_OPTIONS = (
    "request_timeout_ms",
    "ssl_context",
    "security_protocol",
    "sasl_mechanism",
    "sasl_plain_username",
    "sasl_plain_password",
    "sasl_kerberos_service_name",
    "sasl_kerberos_domain_name",
    "sasl_oauth_token_provider",
)
_HOSTNAME_MISMATCH = 62  # X509_V_ERR_HOSTNAME_MISMATCH
_EXPIRED = 10  # X509_V_ERR_CERT_HAS_EXPIRED


def not_trusted(where: str, error: ssl.SSLCertVerificationError) -> str:
    """Why a broker's certificate is not trusted, and what to do, which depends on why."""
    told = f"{where}: its TLS certificate is not trusted ({error.verify_message}); "
    if error.verify_code == _EXPIRED:
        return told + "the broker needs a certificate renewed (or esk's clock is wrong): no setting of esk's mends it"
    if error.verify_code == _HOSTNAME_MISMATCH:
        return told + (
            "ESK_KAFKA__BOOTSTRAP_SERVERS names the brokers as their certificates do not: name them as they do "
            "(ESK_KAFKA__SSL_CHECK_HOSTNAME=false skips the host name check)"
        )
    return told + "ESK_KAFKA__SSL_CAFILE names the CA certificates to trust (PEM)"


def _detail(error: KafkaError) -> str:
    """The broker's own words ("... due to invalid credentials ..."), else what the error
    code means (aiokafka then gives the connection as the error's argument)."""
    if error.args and isinstance(error.args[0], str):
        return str(error.args[0])
    return str(getattr(error, "description", type(error).__name__)).rstrip(".")
