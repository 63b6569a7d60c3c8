"""A broker of its own for the security tests: its client listener is SASL_SSL (TLS with a
certificate made here by openssl, SCRAM-SHA-512 users created when its storage is
formatted) and its authorizer refuses what no ACL allows, started through the same settings
a user would give `esk broker`. Each test's app is granted the ACLs `esk topics acls`
prints, by Kafka's own kafka-acls tool run as a super user: no more."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import uuid
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from esk.broker import EmbeddedBroker
from esk.broker.embedded import java_executable, kafka_classpath
from esk.broker.ports import listening_ports
from esk.kafka.acls import application_acls
from esk.settings import BrokerSaslSslSettings, BrokerSettings, Settings

USER, PASSWORD = "esk-app", 's3cret=[with]"odd" characters'
ADMIN, ADMIN_PASSWORD = "acl-admin", "admin-s3cret"  # a super user: grants the ACLs
# A user granted no Write anywhere: Kafka lets any user that may write some topic start an
# idempotent producer, and USER may write the topics of every test's app.
READER, READER_PASSWORD = "esk-reader", "reader-s3cret"


@dataclass(frozen=True)
class Certificates:
    keystore: Path  # the broker's private key and self-signed certificate, PEM
    ca: Path  # that certificate alone: what clients trust
    stranger_ca: Path  # another self-signed certificate: trusting it, a client must refuse the broker
    client_certificate: Path  # what esk's clients present: the broker trusts it as its own CA
    client_key: Path  # its key, PKCS#8 encrypted with CLIENT_KEY_PASSWORD


CLIENT_KEY_PASSWORD = "client-key-s3cret"


def self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    """A fresh key and a self-signed certificate for 127.0.0.1, as PEM: the key (PKCS#8,
    as Kafka wants it) and the certificate in one file, and the certificate alone."""
    key, certificate = folder / f"{name}.key", folder / f"{name}.crt"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(certificate), "-days", "2", "-subj", f"/CN={name}",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    keystore = folder / f"{name}.pem"
    keystore.write_text(key.read_text() + certificate.read_text())
    return keystore, certificate


@pytest.fixture(scope="session")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: the security tests make their certificates with it")
    folder = tmp_path_factory.mktemp("certificates")
    keystore, ca = self_signed(folder, "broker")
    _, stranger = self_signed(folder, "stranger")
    _, client = self_signed(folder, "esk-client")
    encrypted_key = folder / "esk-client.encrypted.key"
    subprocess.run(
        ["openssl", "pkcs8", "-topk8", "-v2", "aes-256-cbc", "-in", str(folder / "esk-client.key"),
         "-out", str(encrypted_key), "-passout", f"pass:{CLIENT_KEY_PASSWORD}"],
        check=True, capture_output=True,
    )  # fmt: skip
    return Certificates(keystore, ca, stranger, client, encrypted_key)


@pytest.fixture(scope="session")
def secured_broker(tmp_path_factory: pytest.TempPathFactory, certificates: Certificates) -> Iterator[EmbeddedBroker]:
    port, controller_port, internal_port = listening_ports("127.0.0.1", 3)
    sasl_ssl = BrokerSaslSslSettings(
        keystore=certificates.keystore,
        users={USER: PASSWORD, ADMIN: ADMIN_PASSWORD, READER: READER_PASSWORD},
        internal_port=internal_port,
        client_ca=certificates.client_certificate,
        acls=True,
        super_users=[ADMIN],
    )
    data_dir = tmp_path_factory.mktemp("secured-broker")
    broker = EmbeddedBroker(BrokerSettings(port=port, controller_port=controller_port, data_dir=data_dir, sasl_ssl=sasl_ssl))
    broker.start()
    yield broker
    broker.stop()


def kafka_security(broker: EmbeddedBroker, certificates: Certificates, **overrides: Any) -> dict[str, Any]:
    """What a user sets (ESK_KAFKA__*) to reach the secured broker: nothing else."""
    return {
        "bootstrap_servers": broker.bootstrap,
        "security_protocol": "SASL_SSL",
        "ssl_cafile": str(certificates.ca),
        "ssl_certfile": str(certificates.client_certificate),
        "ssl_keyfile": str(certificates.client_key),
        "ssl_password": CLIENT_KEY_PASSWORD,
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": USER,
        "sasl_plain_password": PASSWORD,
        **overrides,
    }


def grant(broker: EmbeddedBroker, certificates: Certificates, settings: Settings, only: Collection[str] | None = None) -> None:
    """Run, as the super user, the `kafka-acls` commands esk prints for `settings.app` and
    USER (those of the resource types `only`, if given)."""
    acls = [acl for acl in application_acls(settings) if only is None or acl.resource_type in only]
    kafka_acls(certificates, [acl.kafka_acls_command(settings.bootstrap_servers, f"User:{USER}") for acl in acls])


def kafka_acls(certificates: Certificates, lines: list[str]) -> None:
    """Run `kafka-acls.sh` command lines with Kafka's own tool, as the super user."""
    admin_config = Path(str(certificates.ca) + ".admin.properties")
    admin_config.write_text(
        "security.protocol=SASL_SSL\nsasl.mechanism=SCRAM-SHA-512\nssl.truststore.type=PEM\n"
        f"ssl.truststore.location={certificates.ca}\nssl.keystore.type=PEM\n"
        f"ssl.keystore.location={certificates.client_certificate.with_suffix('.pem')}\n"
        "sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="{ADMIN}" password="{ADMIN_PASSWORD}";\n'
    )
    java, classpath = java_executable("java"), kafka_classpath(None)
    running = [
        subprocess.Popen(
            [java, "-cp", classpath, "org.apache.kafka.tools.AclCommand", *arguments, "--command-config", str(admin_config)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for tool, *arguments in map(shlex.split, lines)
        if tool == "kafka-acls.sh"
    ]  # fmt: skip
    assert len(running) == len(lines)
    for process in running:
        output, _ = process.communicate(timeout=60)
        assert process.returncode == 0, output


@pytest.fixture
def secured_settings(secured_broker: EmbeddedBroker, certificates: Certificates, tmp_path: Path) -> Settings:
    settings = secured_settings_of(secured_broker, certificates, tmp_path)
    grant(secured_broker, certificates, settings)
    return settings


def secured_settings_of(secured_broker: EmbeddedBroker, certificates: Certificates, tmp_path: Path) -> Settings:
    """A new app on the secured broker, as USER, with no ACL granted yet."""
    return Settings(
        app=f"t{uuid.uuid4().hex[:10]}",
        kafka=kafka_security(secured_broker, certificates),
        topics={"partitions": 2},
        processor={"state_dir": tmp_path / "processor", "commit_interval_ms": 20, "metrics_port": None},
        api={"state_dir": tmp_path / "api", "port": 0},
        subscriber={"data_dir": tmp_path / "subscriptions", "metrics_port": None},
        projections={"warehouse_dir": tmp_path / "warehouse"},
        _env_file=None,
    )
