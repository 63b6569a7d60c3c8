"""Read-your-writes for the reads of what follows the events topics (a read model, the
history index): a read given positions (`after`: the tokens of commands' answers) waits,
`wait_ms` at most, until what it reads has reached them, and answers 503 `not_caught_up`
with how far it got when it has not."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, replace

from ..projections.positions import Position, Positions, unreflected
from ..projections.positions import as_json as positions_json
from .problems import Problem

READ_WAIT_DEFAULT_S = 5.0  # with `after` and no `wait_ms`
READ_WAIT_POLL_S = 0.1  # for what cannot say when it moves (a read model's checkpoint)


@dataclass(frozen=True)
class ReadAfter:
    wanted: list[Position]
    wait_s: float

    @classmethod
    def of(cls, tokens: Iterable[str], wait_ms: int | None, max_wait_s: float) -> ReadAfter:
        """The request's `after` and `wait_ms`; 400 `invalid_wait`, `invalid_position`."""
        if wait_ms is not None and wait_ms < 0:
            raise Problem(400, "invalid_wait", "wait_ms must be >= 0")
        try:
            wanted = [Position.parse(token) for token in tokens]
        except ValueError as error:
            raise Problem(400, "invalid_position", str(error)) from None
        default_s = READ_WAIT_DEFAULT_S if wanted else 0.0
        return cls(wanted, min(default_s if wait_ms is None else wait_ms / 1000, max_wait_s))

    async def until(self, ready: asyncio.Event) -> ReadAfter:
        """Waits (its wait at most) for `ready`; what is left of its wait after that."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        if not ready.is_set() and self.wait_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ready.wait(), self.wait_s)
        return replace(self, wait_s=max(0.0, self.wait_s - (loop.time() - started)))

    def check_topics(self, what: str, topics: Collection[str]) -> None:
        """400 `invalid_position` for a position on a topic `what` does not read: it would
        never be reached."""
        foreign = [p.token() for p in self.wanted if p.topic not in topics]
        if foreign:
            raise Problem(400, "invalid_position", f"{what} does not read {', '.join(foreign)}; it reads {', '.join(sorted(topics))}")

    def check_partitions(self, partitions: int) -> None:
        """400 `invalid_position` for a position on a partition past the events topics'
        (ESK_TOPICS__PARTITIONS, which `esk topics init` holds them to): it would never be
        reached (a token mistyped, or of another cluster). From the settings, not Kafka: a
        read of a read model needs no broker."""
        for p in self.wanted:
            if p.partition >= partitions:
                raise Problem(400, "invalid_position", f"{p.token()}: {p.topic} has partitions 0 to {partitions - 1}")

    async def reflected(
        self,
        what: str,
        positions: Callable[[], Awaitable[Positions]],
        moved: Callable[[], asyncio.Future[None]] | None = None,
        settled: Callable[[], bool] = lambda: True,
    ) -> Positions:
        """`positions()` once they reach every wanted position, and `settled()` holds after
        reading them (a read model built: a read that waits without positions waits for
        that). `moved()`, when given, is a future done when they may have moved: the read
        answers then rather than at the next poll."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while True:
            # Asked for before looking, so a move in between still wakes us.
            change = moved() if moved is not None else None
            try:
                current = await positions()
                missing = unreflected(current, self.wanted)
                if not missing and settled():
                    return current
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise Problem(
                        503, "not_caught_up", f"{what} has not read up to {', '.join(p.token() for p in missing)} yet",
                        {"Retry-After": "1"}, positions=positions_json(current),
                    )
                if change is None:
                    await asyncio.sleep(min(READ_WAIT_POLL_S, remaining))
                else:
                    await asyncio.wait([change], timeout=remaining)
            finally:
                if change is not None:
                    change.cancel()
