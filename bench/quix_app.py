"""The peer: esk's accounts validation as a Quix Streams application (public API only),
with RocksDB state and exactly-once processing, reading the same commands topic.

    python -m bench.quix_app BOOTSTRAP TOPIC GROUP STATE_DIR PREFIX

Per command, like esk: de-duplicate by command id, check the expected version, validate
(open / deposit / withdraw with insufficient_funds), update the state, and emit the event
and the outcome.
"""

from __future__ import annotations

import sys
from typing import Any

from quixstreams import Application, State


def handle(command: dict[str, Any], state: State[str, Any]) -> dict[str, Any]:
    command_id = command["command_id"]
    seen = state.get(f"c/{command_id}")
    if seen is not None:
        return {"outcome": seen, "event": None}
    account: dict[str, Any] | None = state.get("account")
    version = account["version"] if account else 0
    name, payload = command["command"], command["payload"]
    event = None
    if (command.get("expected_version") is not None and command["expected_version"] != version) or (command.get("expect_new") and account is not None):
        outcome = {"status": "precondition_failed", "version": version}
    elif name == "open":
        if account is not None:
            outcome = {"status": "rejected", "code": "already_exists", "version": version}
        else:
            account = {"owner": payload["owner"], "balance": 0, "status": "open", "version": 1}
            event = {"type": "Opened", "version": 1, "data": payload}
    elif account is None:
        outcome = {"status": "rejected", "code": "not_found", "version": 0}
    elif name == "withdraw" and payload["amount"] > account["balance"]:
        outcome = {"status": "rejected", "code": "insufficient_funds", "version": version}
    else:
        sign = 1 if name == "deposit" else -1
        account = {**account, "balance": account["balance"] + sign * payload["amount"], "version": version + 1}
        event = {"type": "Deposited" if sign > 0 else "Withdrawn", "version": version + 1, "data": payload}
    if event is not None:
        assert account is not None, "every event comes with the account it made or changed"
        state.set("account", account)
        outcome = {"status": "accepted", "version": account["version"], "events": [event]}
    outcome = {"command_id": command_id, **outcome}
    state.set(f"c/{command_id}", outcome)
    return {"outcome": outcome, "event": event}


def main() -> None:
    bootstrap, topic, group, state_dir, prefix = sys.argv[1:6]
    app = Application(
        broker_address=bootstrap,
        consumer_group=group,
        processing_guarantee="exactly-once",
        state_dir=state_dir,
        auto_offset_reset="earliest",
    )
    commands = app.topic(topic, key_deserializer="bytes", value_deserializer="json")
    events = app.topic(f"{prefix}.quix.events", value_serializer="json")
    results = app.topic(f"{prefix}.quix.results", value_serializer="json")
    handled = app.dataframe(commands).apply(handle, stateful=True)
    handled.apply(lambda v: v["outcome"]).to_topic(results)
    handled.filter(lambda v: v["event"] is not None).apply(lambda v: v["event"]).to_topic(events)
    app.run()


if __name__ == "__main__":
    main()
