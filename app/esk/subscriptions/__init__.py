"""Subscriptions: a user's handlers of the event topics, run by `esk subscriber NAME`.

`api.py` is what a user declares; `routing.py` which handler a record goes to; `worker.py`
one input partition's records in order, with retries and parking; the sinks keep effects,
offsets and parked events together (`kafka_sinks.py`, `database_sink.py`); `runner.py` is
the consumer group member; `operations.py` what `esk subscriptions …` does; `testing.py`
runs handlers against a list of events without Kafka.
"""
