"""Who owns which commands partition, and who keeps a warm standby copy of it.

The group leader runs `plan` on what every member reported when it joined: the
partitions it owned in the previous generation and the changelog offsets of the stores
it keeps warm. The plan is balanced (every member owns ⌊n/m⌋ or ⌈n/m⌉ partitions) and
moves as little state as it can: a partition stays with its previous owner; otherwise
it goes to the member whose copy is furthest along the changelog; only then to the
least loaded member, which must restore it. Each partition then gets up to
`standby_replicas` standbys on other members that keep standbys themselves: an owner's
partitions on as many members as can be, then the members with the fewest, members with
a copy among equals.

The standby partitions travel to each member in the assignment's user_data; members
without standby replicas configured simply get none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import orjson
from aiokafka.cluster import ClusterMetadata
from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata


@dataclass
class MemberState:
    """What a member reports when it joins."""

    owned: set[int] = field(default_factory=set)
    warm: dict[int, int] = field(default_factory=dict)  # partition -> changelog offset of its copy
    standby_replicas: int = 0

    def encode(self) -> bytes:
        return orjson.dumps(
            {"owned": sorted(self.owned), "warm": {str(p): o for p, o in self.warm.items()}, "standby_replicas": self.standby_replicas}
        )

    @classmethod
    def decode(cls, data: bytes) -> MemberState:
        try:
            raw = orjson.loads(data) if data else {}
            return cls(
                set(raw.get("owned", [])),
                {int(p): int(o) for p, o in raw.get("warm", {}).items()},
                int(raw.get("standby_replicas", 0)),
            )
        except (orjson.JSONDecodeError, TypeError, ValueError, AttributeError):
            return cls()  # a member that reports nothing usable gets a plain, cold share


@dataclass
class MemberPlan:
    active: list[int] = field(default_factory=list)
    standby: list[int] = field(default_factory=list)


def plan(partitions: Iterable[int], members: Mapping[str, MemberState], standby_replicas: int) -> dict[str, MemberPlan]:
    ids = sorted(members)
    result = {member: MemberPlan() for member in ids}
    if not ids:
        return result
    ordered = sorted(partitions)
    floor, extra = divmod(len(ordered), len(ids))

    def has_room(member: str) -> bool:
        held = len(result[member].active)
        at_ceiling = sum(1 for m in ids if len(result[m].active) > floor)
        return held < floor or (held == floor and at_ceiling < extra)

    def warmth(member: str, partition: int) -> int:
        return members[member].warm.get(partition, -1)

    owner: dict[int, str] = {}
    for partition in ordered:  # stay where it was
        previous = [m for m in ids if partition in members[m].owned and has_room(m)]
        if previous:
            # two claimants means one is a zombie of an older generation: the warmer one wins
            owner[partition] = max(previous, key=lambda m: warmth(m, partition))
            result[owner[partition]].active.append(partition)
    for partition in ordered:  # else the warmest copy, else the least loaded member
        if partition in owner:
            continue
        candidates = [m for m in ids if has_room(m)]
        owner[partition] = max(candidates, key=lambda m: (warmth(m, partition), -len(result[m].active)))
        result[owner[partition]].active.append(partition)

    # Only members that run with standby replicas configured keep copies for others. An
    # owner's partitions get their standbys on as many members as can be, so that should it
    # fail, they move to several members, each with its copy, rather than pile on one. Then
    # the fewest standbys; a member with a copy only among equals, as a copy left on disk
    # (for STATE_CLEANUP_DELAY_S) would otherwise draw every standby of its partitions. A
    # copy counts, not how far along it is: a record's lag would move standbys at every
    # rebalance, each to be built again.
    keepers = [m for m in ids if members[m].standby_replicas > 0]

    def kept_for(keeper: str, partition: int) -> int:
        """How many of the partition's owner's partitions `keeper` keeps already."""
        return sum(1 for p in result[keeper].standby if owner[p] == owner[partition])

    def has_copy(member: str, partition: int) -> bool:
        return partition in members[member].warm

    for partition in ordered:
        others = [m for m in keepers if m != owner[partition]]
        others.sort(key=lambda m: (kept_for(m, partition), len(result[m].standby), not has_copy(m, partition)))
        for member in others[:standby_replicas]:
            result[member].standby.append(partition)
    _even_out_standbys(result, owner, keepers, kept_for, has_copy)
    return result


def _even_out_standbys(
    result: dict[str, MemberPlan],
    owner: Mapping[int, str],
    keepers: list[str],
    kept_for: Callable[[str, int], int],
    has_copy: Callable[[str, int], bool],
) -> None:
    """Standbys moved from members that keep two more than another to that one, until none
    does or none can move: taking them in partition order, the members that own the
    partitions placed last could be left without any."""
    while True:
        pairs = sorted(
            ((giver, taker) for giver in keepers for taker in keepers
             if len(result[giver].standby) - len(result[taker].standby) >= 2),
            key=lambda pair: len(result[pair[1]].standby) - len(result[pair[0]].standby),
        )  # fmt: skip
        for giver, taker in pairs:
            movable = [p for p in result[giver].standby if owner[p] != taker and p not in result[taker].standby]
            if movable:
                moved = min(movable, key=lambda p: (kept_for(taker, p), not has_copy(taker, p)))
                result[giver].standby.remove(moved)
                result[taker].standby.append(moved)
                break
        else:
            return


class StandbyAssignor(AbstractPartitionAssignor):  # type: ignore[misc]  # aiokafka ships no type hints: its base is Any
    """aiokafka's side of `plan`. aiokafka calls these on the instance it was given."""

    name = "esk-standby"
    version = 0

    def __init__(self, topic: str, standby_replicas: int, warm: Callable[[], dict[int, int]]) -> None:
        self.topic = topic
        self.standby_replicas = standby_replicas
        self._warm = warm
        self.owned: set[int] = set()
        self.standby: set[int] = set()

    def metadata(self, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:
        state = MemberState(set(self.owned), self._warm(), self.standby_replicas)
        return ConsumerProtocolMemberMetadata(self.version, list(topics), state.encode())

    def assign(
        self, cluster: ClusterMetadata, members: Mapping[str, ConsumerProtocolMemberMetadata]
    ) -> dict[str, ConsumerProtocolMemberAssignment]:
        partitions = cluster.partitions_for_topic(self.topic) or set()
        states = {member: MemberState.decode(meta.user_data) for member, meta in members.items()}
        # Copies per partition: the largest count any member asks for, so a rolling change
        # of the setting takes effect as members restart with it.
        replicas = max((s.standby_replicas for s in states.values()), default=0)
        plans = plan(partitions, states, replicas)
        return {
            member: ConsumerProtocolMemberAssignment(
                self.version,
                [(self.topic, sorted(p.active))] if p.active else [],
                orjson.dumps({"standby": sorted(p.standby)}),
            )
            for member, p in plans.items()
        }

    def on_assignment(self, assignment: ConsumerProtocolMemberAssignment) -> None:
        self.owned = {tp.partition for tp in assignment.partitions() if tp.topic == self.topic}
        try:
            self.standby = set(orjson.loads(assignment.user_data).get("standby", [])) - self.owned
        except (orjson.JSONDecodeError, AttributeError, TypeError):
            self.standby = set()
