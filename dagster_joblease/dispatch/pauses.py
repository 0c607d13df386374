"""What one dispatcher knows of its limit groups' pauses between database reads, and how long its claims
take: state shared by the delivery threads (a downstream's ``Retry-After`` holds the group off at once)
and the limit groups' claims (:mod:`dagster_joblease.dispatch.groups`)."""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Mapping

from dagster_joblease.dispatch.recorder import DispatchReport
from dagster_joblease.storage import route_groups

__all__ = ["ClaimTimer", "Pauses"]


class Pauses:
    """Per limit group, the local monotonic time until which this dispatcher holds it off, and when its
    own write of a pause finished (``inf`` while a delivery thread is writing it): a database read that
    began later and finds no pause may end the local one (an operator's ``joblease outbox resume``)."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}
        self._settled: dict[str, float] = {}

    def until(self, group: str) -> float:
        """The local monotonic time until which ``group`` is held off (0.0: it is not)."""
        return self._until.get(group, 0.0)

    def holds(self, group: str, now: float) -> bool:
        """Whether ``group`` is held off at local time ``now``."""
        return self.until(group) > now

    def writing(self, group: str, until: float) -> None:
        """A delivery thread starts writing a pause of ``group`` lasting to ``until``: held off at once."""
        self._settled[group] = math.inf
        self._until[group] = max(self.until(group), until)

    def written(self, group: str) -> None:
        """The pause write of :meth:`writing` finished (committed or not)."""
        self._settled[group] = time.monotonic()

    def extend(self, paused_ms: Mapping[str, int], now: float) -> None:
        """Pauses read from the database (group → remaining ms) held off from local time ``now``."""
        for name, remaining_ms in paused_ms.items():
            self._until[name] = now + remaining_ms / 1000

    def hold_off(
        self, group: str, state: route_groups.GroupState, report: DispatchReport, now: float
    ) -> None:
        """A group paused in the database: named in ``report``, and held off locally until its end."""
        assert state.paused_until is not None
        report.paused[group] = (state.paused_until.isoformat(), state.pause_reason or "")
        self._until[group] = now + state.pause_remaining_ms / 1000

    def note(
        self,
        groups: Collection[str],
        states: Mapping[str, route_groups.GroupState],
        report: DispatchReport,
        started: float,
    ) -> set[str]:
        """The groups ``states`` says are paused, noted in ``report`` and held off locally; a local pause
        of ``groups`` the database no longer has (as read after this dispatcher's own pause write) ends:
        perhaps early, by an operator's ``joblease outbox resume``."""
        paused = {name for name, state in states.items() if state.paused}
        for name in set(groups) - paused:
            if name in self._until and self._settled.get(name, -math.inf) < started:
                del self._until[name]
        for name in paused:
            self.hold_off(name, states[name], report, started)
        return paused


class ClaimTimer:
    """How long a claim takes here, to its commit (smoothed): rate admissions start that much ahead (x2),
    so a request is not already late when its claim commits."""

    def __init__(self) -> None:
        self.seconds = 0.005
        self.started = 0.0

    def start(self) -> float:
        """A claim's transaction begins now (local monotonic time, returned)."""
        self.started = time.monotonic()
        return self.started

    def took(self) -> None:
        """The claim begun at :meth:`start` committed."""
        self.seconds = 0.8 * self.seconds + 0.2 * (time.monotonic() - self.started)
