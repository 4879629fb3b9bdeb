"""EngineCore: one engine step, on the engine's loop thread. The step is four lines, each
doing only what it says:

```
batch  = scheduler.schedule()          # plan: admit (LPM + aging), chunk, decode, retract, fork
out    = executor.run(batch)           # compute: forward + masks + sampling -> StepOutput
result = scheduler.update(batch, out)  # sequence state: tokens appended, stops, pages released
processor.emit(result)                 # output state: deltas to the requests' sinks
```

Failures are values on the same path: a request `schedule` cannot schedule rides in
`batch.failed`; sampling errors of one request in `StepOutput.errors`; a forward that fails is
attributed by running each request alone (`_compute`): the culprits are dropped from the batch
(`StepOutput.dropped`) and the rest runs again; if it still fails, `StepOutput.batch_error`
fails that step's requests, never the others.
"""

from __future__ import annotations

import logging

from radixlm.runtime.batch import ScheduledBatch, StepOutput
from radixlm.runtime.executor import Executor
from radixlm.runtime.output_processor import OutputProcessor
from radixlm.runtime.request import RequestOutput
from radixlm.runtime.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, processor: OutputProcessor):
        self.scheduler = scheduler
        self.executor = executor
        self.processor = processor

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        batch, out = self._compute(batch)
        result = self.scheduler.update(batch, out)
        return self.processor.emit(result)

    def _compute(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, StepOutput]:
        """`executor.run(batch)`, with a failing forward attributed to its requests."""
        if not batch:
            return batch, StepOutput()
        try:
            return batch, self.executor.run(batch)
        except Exception:  # noqa: BLE001 - attribute it below
            logger.exception("step failed; running each request alone to find the cause")
        culprits, error = [], None
        for item in batch.items:
            try:
                self.executor.probe(ScheduledBatch([item]))
            except Exception as exc:  # noqa: BLE001 - this request's forward
                culprits.append(item.req)
                error = exc
        dropped: list = []
        if culprits:
            logger.error("failing %d request(s) whose forward fails: %r", len(culprits), error)
            batch, removed = batch.without(culprits)
            message = f"internal error in the forward: {error!r}"
            dropped = [(r, message) for r in removed]
            if not batch:
                return batch, StepOutput(dropped=dropped)
        try:
            out = self.executor.run(batch)
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
            logger.exception("engine step failed; failing the requests of that step")
            out = StepOutput(batch_error=f"internal error: {type(exc).__name__}: {exc}")
        out.dropped = dropped
        return batch, out
