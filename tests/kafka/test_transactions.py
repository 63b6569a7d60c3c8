"""The transactional producer as esk configures it (no broker: nothing is sent)."""

from __future__ import annotations

import aiokafka.producer.sender

from esk.kafka.transactions import CONCURRENT_TRANSACTIONS_RETRY_S, transactional_producer
from esk.settings import Settings


async def test_the_producer_is_transactional_and_retries_concurrent_transactions_sooner() -> None:
    settings = Settings(_env_file=None)
    producer = transactional_producer(settings, "esk-test.3", 4096, client_id="esk-test-3")
    try:
        assert producer._txn_manager is not None
        assert producer._txn_manager.transactional_id == "esk-test.3"
        assert producer._txn_manager.transaction_timeout_ms == settings.processor.transaction_timeout_ms
        assert producer.client._client_id == "esk-test-3"
        # read by aiokafka's sender when the broker answers CONCURRENT_TRANSACTIONS
        assert aiokafka.producer.sender.BACKOFF_OVERRIDE == CONCURRENT_TRANSACTIONS_RETRY_S < 0.02
    finally:
        await producer.stop()
