"""The keyword arguments every aiokafka client gets: bootstrap servers and security.

TLS and SASL settings pass through untouched; anything else aiokafka accepts goes in
`ESK_KAFKA__EXTRA` as JSON.
"""

from __future__ import annotations

from typing import Any

from aiokafka.helpers import create_ssl_context

from ..settings import Settings


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
            password=kafka.ssl_password,
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

