"""The transactional producer a StreamTask commits with, as esk configures it.

Between two transactions of one producer the broker is still writing the first one's
commit markers for a few milliseconds. A transaction begun in that window has its first
AddPartitionsToTxn refused with CONCURRENT_TRANSACTIONS, and aiokafka retries it after a
fixed 20 ms (`BACKOFF_OVERRIDE`, KAFKA-5477), not a setting. A task commits batch after
batch, so nearly every commit paid those 20 ms: back-to-back transactions of 11 records
took 31 ms each, 13 ms with a 5 ms retry (same broker, same run). The commit is what an
HTTP client waits for, so esk retries after 5 ms.
"""

from __future__ import annotations

import logging

import aiokafka.producer.sender
from aiokafka import AIOKafkaProducer

from .client_options import client_options
from ..settings import Settings

log = logging.getLogger(__name__)

CONCURRENT_TRANSACTIONS_RETRY_S = 0.005


def _retry_concurrent_transactions_sooner() -> None:
    if not hasattr(aiokafka.producer.sender, "BACKOFF_OVERRIDE"):
        log.warning("aiokafka has no BACKOFF_OVERRIDE; transactions keep its own retry after CONCURRENT_TRANSACTIONS")
        return
    aiokafka.producer.sender.BACKOFF_OVERRIDE = CONCURRENT_TRANSACTIONS_RETRY_S


def transactional_producer(
    settings: Settings, transactional_id: str, max_batch_size: int, client_id: str | None = None
) -> AIOKafkaProducer:
    """An idempotent producer with acks=all and `transactional_id`; make it inside the
    running loop, then `start()` it (which fences the id's previous owner)."""
    _retry_concurrent_transactions_sooner()
    options = {"client_id": client_id} if client_id else {}
    return AIOKafkaProducer(
        **client_options(settings),
        **options,
        transactional_id=transactional_id,
        enable_idempotence=True,
        acks="all",
        linger_ms=2,
        max_batch_size=max_batch_size,
        transaction_timeout_ms=settings.processor.transaction_timeout_ms,
    )
