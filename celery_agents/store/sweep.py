"""The outbox of owed steps and the dispatched calls, as the sweeper reads and settles them."""

from __future__ import annotations

from celery_agents.model import TrackedCall
from celery_agents.model.recovery import Recovery
from celery_agents.store.core import UNREACHED, StoreCore
from celery_agents.store.records import Swept


class SweepStore(StoreCore):
    """The outbox and the dispatched calls, as the sweeper settles them."""

    def owed(self, older_than: float, limit: int = 200) -> list[str]:
        """Sessions owed a step since before `older_than` (Redis time, seconds), oldest first."""
        return [sid for sid, _ in self.due("owed", older_than, limit)]

    def sweep_owed(self, candidates: list[tuple[str, bool]], now: float) -> list[Swept]:
        """Settle outbox entries atomically, each (session id, whether a step no worker picked up
        counts as lost); one round trip; one out of reach (`in_reach`) is left for the next
        sweep. See `sweep_owed.lua`."""
        pipe = self.client.pipeline(transaction=False)
        for sid, lost in candidates:
            self._run("sweep_owed", sid, ["1" if lost else "0"], now=now, pipe=pipe)
        return [
            Swept(sid, Recovery(res[0]), version=int(res[1]), priority=int(res[2]))
            if res[0] == Recovery.REPUBLISH
            else Swept(sid, Recovery(res[0]))
            for (sid, _), res in zip(candidates, self.in_reach(pipe), strict=True)
            if res is not UNREACHED
        ]

    def sweep_dispatched(self, candidates: list[tuple[str, str, bool]], now: float) -> list[Swept]:
        """Settle dispatched calls atomically, each (session id, field, whether a call no worker
        started counts as lost); one round trip; one out of reach (`in_reach`) is left for the
        next sweep. See `sweep_dispatched.lua`."""
        pipe = self.client.pipeline(transaction=False)
        k = self.keys
        for sid, field, lost in candidates:
            extra = (k.call_lease(sid, field), k.call_started(sid, field))
            self._run("sweep_dispatched", sid, [field, "1" if lost else "0"], extra, now=now, pipe=pipe)
        return [
            Swept(
                sid,
                Recovery(res[0]),
                field=field,
                call=TrackedCall.model_validate_json(res[1]) if res[0] == Recovery.REPUBLISH else None,
            )
            for (sid, field, _), res in zip(candidates, self.in_reach(pipe), strict=True)
            if res is not UNREACHED
        ]
