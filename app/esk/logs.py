"""The logging of every esk process: one handler on the root logger, writing text or one
JSON object a line (`ESK_LOG_FORMAT`), and the Kafka client's noise turned into what an
operator can act on during an incident.

While a broker is down, aiokafka logs an ERROR or a WARNING for every request it retries:
a three-broker cluster with a broker killed every 10 to 20 s made esk's processes write
thousands of such lines in two minutes, nearly all "Unable connect to node" and
NodeNotReadyError. `BrokerConnectionFilter` says once per broker that it is unreachable
(WARNING) and once that it answers again (INFO, with the failed attempts and how long it
took), or that it refuses esk's client (its credentials or certificate: the broker
answers), keeps every error the client retries by itself at DEBUG, and sums those up at
most once a minute when no unreachable broker explains them (a broker that answers slowly).
"""

from __future__ import annotations

import logging
import ssl
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Literal, TextIO

from aiokafka.errors import AuthenticationFailedError, KafkaError, SaslAuthenticationFailed
from pythonjsonlogger.orjson import OrjsonFormatter

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Libraries that log too much below WARNING: aiokafka a line per request at DEBUG, py4j
# (Spark's bridge) every call.
QUIET_LIBRARIES = ("aiokafka", "py4j")

# aiokafka's own messages (aiokafka/client.py and conn.py, 0.14), matched on the format
# string, which carries no data, rather than on the text.
CONNECT_FAILED = "Unable connect to node with id %s: %s"  # ERROR: a connection attempt failed
BOOTSTRAP_FAILED = 'Unable connect to "%s:%s": %s'  # ERROR: the same, to a bootstrap address
CONNECTING = "Initiating connection to node %s at %s:%s"  # DEBUG: names a node's address
RESPONSE = "Response from %s:%d %d: %s"  # DEBUG (aiokafka.conn): a broker answered
AUTHENTICATED = "Authenticated as %s via %s"  # INFO (aiokafka.conn): a SASL (PLAIN, SCRAM) handshake went through
METADATA_FAILED = "Unable to update metadata from %s"  # ERROR: no broker answered; tried again at once
# What a group member says while its coordinator is away (aiokafka/consumer/group_coordinator.py):
# it finds the coordinator again, and rejoins the group when its session expired meanwhile.
SESSION_EXPIRED = "heartbeat session expired"
COORDINATOR_LOST = {
    "Heartbeat session expired - marking coordinator dead": SESSION_EXPIRED,  # ERROR
    "Marking the coordinator dead (node %s)for group %s.": "group coordinator lost",  # WARNING
    "Heartbeat failed for group %s: coordinator (node %s) is either not started or not valid": "group coordinator moved",  # WARNING
}

# What a group member says, at WARNING, of the group's routine (a member joined or left):
# INFO here, as no one has anything to do about it.
ROUTINE = {"Heartbeat failed for group %s because it is rebalancing"}

SUMMARY_INTERVAL_S = 60.0
# Connection attempts run concurrently (clients, connection groups): one begun before the
# broker answered can fail just after. Such a failure is no new outage.
RECOVERY_GRACE_S = 5.0
# A group member's session that expired this long after every broker answered again did
# not expire for want of a broker.
AFTER_OUTAGE_S = 60.0


def configure_logging(level: str | int = "INFO", log_format: LogFormat = "text", stream: TextIO | None = None) -> logging.Handler:
    """Give the root logger esk's handler (replacing one an earlier call installed) and
    return it. Idempotent: every command of the CLI calls it."""
    root = logging.getLogger()
    root.setLevel(level)
    threshold = root.level
    for noisy in QUIET_LIBRARIES:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, threshold))
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(json_formatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(BrokerConnectionFilter(threshold))
    handler.set_name("esk")
    for old in [h for h in root.handlers if h.get_name() == "esk"]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    return handler


def json_formatter() -> logging.Formatter:
    # python-json-logger rather than a hand-made json.dumps: it serialises what a record
    # carries besides the message (`extra=` fields, e.g. trace ids) and any value type,
    # and formats exceptions and stacks; orjson is a dependency of esk already.
    return OrjsonFormatter(
        ["levelname", "name", "message"],
        rename_fields={"levelname": "level", "name": "logger", "exc_info": "exception", "stack_info": "stack"},
        timestamp=True,
    )


@dataclass
class _Outage:
    since: float  # record.created of the first failed attempt
    attempts: int
    retried_before: int  # the filter's count of retried errors when the outage began
    last: float  # record.created of the latest failed attempt
    refused: str | None = None  # "sasl" or "tls": the broker answers, and refuses esk's client


class BrokerConnectionFilter(logging.Filter):
    """Rewrites aiokafka's records, on esk's handler; see the module's docstring.

    A broker is "node N" (from a failed connection to a broker the metadata names) or
    "host:port" (a bootstrap address). That it answers again is seen in aiokafka's DEBUG
    records, which no one reads otherwise: while a broker is unreachable the aiokafka
    logger is lowered to DEBUG, and this filter drops those records once it has read them.
    """

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level
        self.library = logging.getLogger("aiokafka")
        self.library_level = self.library.level or logging.WARNING  # what it logs when all is well
        self.outages: dict[str, _Outage] = {}
        self.addresses: dict[str, str] = {}  # "node 2" -> "127.0.0.1:9093", from CONNECTING
        self.recovered: dict[str, float] = {}  # broker -> record.created of its answer
        self.retried = 0  # retried errors kept at DEBUG, ever
        self.unexplained: Counter[str] = Counter()  # retried errors while every broker answered, by error
        self.summary_due = 0.0
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if not (record.name == "aiokafka" or record.name.startswith("aiokafka.")):
            return True
        with self._lock:
            if not self._rewrite(record):
                return False
        return record.levelno >= self.level

    def _rewrite(self, record: logging.LogRecord) -> bool:
        """Rewrite the record in place; False: drop it."""
        args = record.args if isinstance(record.args, tuple) else ()
        if record.msg == CONNECT_FAILED and len(args) == 2:
            self._failed(record, f"node {args[0]}", args[1])
        elif record.msg == BOOTSTRAP_FAILED and len(args) == 3:
            self._failed(record, f"{args[0]}:{args[1]}", args[2])
        elif record.levelno < logging.WARNING:
            return self._signal(record, args)
        elif isinstance(record.msg, str) and record.msg in ROUTINE:  # a message may be any object
            _set_level(record, logging.INFO)
        elif (kind := retried_kind(record)) is not None:
            self._retried(record, kind)
        return True

    def _failed(self, record: logging.LogRecord, broker: str, error: object) -> None:
        refused = _refused(error)
        outage = self.outages.get(broker)
        if outage is not None:
            outage.attempts += 1
            outage.last = record.created
            if refused is None or outage.refused == refused:
                _demote(record)
                return
            # Away at first (restarted), it answers now, and refuses: what changed is said
            outage.refused = refused
            _replace(record, logging.WARNING, _refusal(broker, error, refused))
            return
        if record.created - self.recovered.get(broker, -RECOVERY_GRACE_S) < RECOVERY_GRACE_S:
            self.retried += 1
            _demote(record)
            return
        if not self.outages:
            self.library.setLevel(logging.DEBUG)  # to see the broker answer again
        self.outages[broker] = _Outage(record.created, 1, self.retried, record.created, refused)
        _replace(
            record,
            logging.WARNING,
            _refusal(broker, error, refused) if refused is not None else
            f"Kafka broker {broker} unreachable ({error}); the Kafka client keeps retrying, "
            "its errors are logged at DEBUG until the broker answers again",
        )  # fmt: skip

    def _signal(self, record: logging.LogRecord, args: tuple[object, ...]) -> bool:
        """A record of aiokafka below WARNING: a node's address, or a broker that answered.
        False for the ones logged only because an outage lowered the logger's level."""
        if record.msg == CONNECTING and len(args) == 3:
            self.addresses[f"node {args[0]}"] = f"{args[1]}:{args[2]}"
        elif record.msg == RESPONSE and len(args) == 4 and self.outages:
            address = f"{args[0]}:{args[1]}"
            # A SASL listener answers before the handshake that refuses the client
            back = [b for b, o in self.outages.items() if address in (b, self.addresses.get(b)) and o.refused != "sasl"]
            if back:
                self._recovered(record, address, back)
                return True
        elif record.msg == AUTHENTICATED and self.outages:
            # It names no broker: the credentials that one took are everyone's
            back = [b for b, o in self.outages.items() if o.refused == "sasl"]
            if back:
                self._recovered(record, self.addresses.get(back[0], back[0]), back)
                return True
        return record.levelno >= self.library_level

    def _recovered(self, record: logging.LogRecord, address: str, brokers: list[str]) -> None:
        lines = []
        for broker in brokers:
            outage = self.outages.pop(broker)
            self.recovered[broker] = record.created
            where = broker if broker == address else f"{broker} ({address})"
            # A process reaches a broker when it needs it: one it needed for nothing for a
            # while after it came back is reached late, and the outage looks longer than it was.
            since_last = record.created - outage.last
            attempts = f"{outage.attempts} failed connection attempt{'s' if outage.attempts != 1 else ''}"
            if since_last > RECOVERY_GRACE_S:
                told = (
                    f"reached again {since_last:.1f} s after the last of {attempts} over "
                    f"{outage.last - outage.since:.1f} s (no request needed it meanwhile: it was away for "
                    f"{outage.last - outage.since:.1f} to {record.created - outage.since:.1f} s)"
                )
            else:
                told = f"reachable again after {attempts} over {record.created - outage.since:.1f} s"
            lines.append(f"Kafka broker {where} {told} ({self.retried - outage.retried_before} retried client errors logged at DEBUG meanwhile)")
        if not self.outages:
            self.library.setLevel(self.library_level)
        _replace(record, logging.INFO, "; ".join(lines))

    def _retried(self, record: logging.LogRecord, kind: str) -> None:
        """An error the client retries by itself: DEBUG, and summed up at most once a
        minute when no unreachable broker explains it."""
        if kind == SESSION_EXPIRED and not self.outages and record.created - max(self.recovered.values(), default=-AFTER_OUTAGE_S) >= AFTER_OUTAGE_S:
            _replace(
                record,
                logging.WARNING,
                "a Kafka group member's heartbeat session expired while every broker answered: its process held up "
                "its event loop (or the group coordinator's broker its answers) for longer than the session timeout; "
                "it rejoins the group, and its partitions may have gone to another member meanwhile",
            )
            return
        self.retried += 1
        if self.outages:
            _demote(record)
            return
        self.unexplained[kind] += 1
        if record.created < self.summary_due:
            _demote(record)
            return
        count = sum(self.unexplained.values())
        kinds = ", ".join(f"{name} x{n}" for name, n in self.unexplained.most_common())
        self.unexplained.clear()
        self.summary_due = record.created + SUMMARY_INTERVAL_S
        _replace(
            record,
            logging.WARNING,
            f"the Kafka client retried {count} request{'s' if count != 1 else ''} ({kinds}), latest: "
            f"{record.getMessage()}; the next {SUMMARY_INTERVAL_S:.0f} s of them are logged at DEBUG and summed up here",
        )


def retried_kind(record: logging.LogRecord) -> str | None:
    """What the Kafka client retries by itself in this record, if anything: the name of a
    retriable KafkaError (instance or class) or socket error among its arguments, or a
    metadata update that no broker answered."""
    if record.msg == METADATA_FAILED:
        return "metadata update failed"
    if isinstance(record.msg, str) and record.msg in COORDINATOR_LOST:
        return COORDINATOR_LOST[record.msg]
    for arg in record.args if isinstance(record.args, tuple) else ():
        kind = arg if isinstance(arg, type) else type(arg)
        if (issubclass(kind, KafkaError) and getattr(kind, "retriable", False)) or issubclass(kind, OSError | TimeoutError):
            return kind.__name__
    return None


def _demote(record: logging.LogRecord) -> None:
    _set_level(record, logging.DEBUG)


def _refused(error: object) -> str | None:
    """"sasl" or "tls" when `error` is a broker refusing esk's client (its credentials, or
    the certificate it shows), not one away; None otherwise."""
    if isinstance(error, SaslAuthenticationFailed | AuthenticationFailedError):
        return "sasl"
    if isinstance(error, ssl.SSLError):
        return "tls"
    return None


def _refusal(broker: str, error: object, refused: str) -> str:
    check = (
        "ESK_KAFKA__SASL_PLAIN_USERNAME and ESK_KAFKA__SASL_PLAIN_PASSWORD (changed on the cluster?)" if refused == "sasl" else
        "ESK_KAFKA__SSL_CAFILE, ESK_KAFKA__SSL_CERTFILE and ESK_KAFKA__SSL_KEYFILE (the broker's or esk's certificate changed?)"
    )  # fmt: skip
    return (
        f"Kafka broker {broker} refuses esk's client ({error}): check {check}; the Kafka client keeps retrying, "
        "its errors are logged at DEBUG until the broker takes it again"
    )


def _set_level(record: logging.LogRecord, level: int) -> None:
    record.levelno, record.levelname = level, logging.getLevelName(level)


def _replace(record: logging.LogRecord, level: int, message: str) -> None:
    _set_level(record, level)
    record.msg, record.args = message, None
