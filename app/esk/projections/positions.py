"""Positions in the event streams: where a command's events are, and how far a read model
has read. They are what read-your-writes compares; no Spark is needed to read them.

A position is a topic partition and an offset on it. A command's answer carries the end
of its aggregate's events partition as written once the command's outcome was in (its
high watermark): every event of the command lies below it. A read model reflects
a position once it has read that partition up to the offset. Its positions are those of
the last micro-batch Structured Streaming finished: the checkpoint writes `commits/<n>`
after batch n's Delta writes, and `offsets/<n>` holds where batch n ended.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..protocol import position
from .catalog import Tables

TopicPartitionKey = tuple[str, int]
Positions = dict[TopicPartitionKey, int]  # (topic, partition) -> offset


_INT32_MAX, _INT64_MAX = 2**31 - 1, 2**63 - 1
_NUMBER = re.compile(r"0|[1-9][0-9]*")


@dataclass(frozen=True)
class Position:
    topic: str
    partition: int
    offset: int

    def token(self) -> str:
        """`<topic>/<partition>/<offset>`: how a client hands a position back."""
        return position(self.topic, self.partition, self.offset)

    @classmethod
    def parse(cls, token: str) -> Position:
        topic, _, rest = token.rpartition("/")
        topic, _, partition = topic.rpartition("/")
        # As esk writes them, and the OpenAPI document's pattern says: "01" is refused there.
        if not topic or not _NUMBER.fullmatch(partition) or not _NUMBER.fullmatch(rest):
            raise ValueError(f"{token!r} is not a position (<topic>/<partition>/<offset>)")
        if int(partition) > _INT32_MAX or int(rest) > _INT64_MAX:  # beyond what Kafka numbers them with
            raise ValueError(f"{token!r} is no Kafka position: a partition fits 32 bits and an offset 64")
        return cls(topic, int(partition), int(rest))

    def as_json(self) -> dict[str, str | int]:
        return {"topic": self.topic, "partition": self.partition, "offset": self.offset, "token": self.token()}


def checkpoint_positions(checkpoint: Path) -> Positions:
    """Where the last finished micro-batch of a streaming query ended; empty before the first."""
    commits = checkpoint / "commits"
    finished = [int(p.name) for p in commits.iterdir() if p.name.isdigit()] if commits.is_dir() else []
    if not finished:
        return {}
    # "v1", the batch's metadata, then one line per source: {"topic": {"partition": offset}}
    lines = (checkpoint / "offsets" / str(max(finished))).read_text().splitlines()[2:]
    positions: Positions = {}
    for line in lines:
        source = json.loads(line)
        if isinstance(source, dict):
            for topic, partitions in source.items():
                for partition, offset in partitions.items():
                    positions[topic, int(partition)] = int(offset)
    return positions


def read_model_positions(tables: Tables, name: str) -> Positions | None:
    """The positions the read model's current table reflects (None: not built yet)."""
    generation = tables.current_generation(name)
    if generation is None:
        return None
    return checkpoint_positions(tables.checkpoint(name, generation))


def unreflected(positions: Positions, wanted: Iterable[Position]) -> list[Position]:
    """The wanted positions that `positions` has not reached yet."""
    return [p for p in wanted if positions.get((p.topic, p.partition), 0) < p.offset]


def as_json(positions: Positions) -> list[dict[str, str | int]]:
    return [Position(topic, partition, offset).as_json() for (topic, partition), offset in sorted(positions.items())]
