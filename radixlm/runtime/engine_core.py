"""EngineCore: one engine step, on the engine's loop thread.

```
batch = scheduler.schedule()          # admit (LPM + aging), chunk prefill, decode, retract, fork
out   = executor.run(batch)           # forward + masks + sampling: StepOutput
scheduler.update(batch, out)          # tokens appended, pages inserted into the radix tree
processor.drain()                     # stop strings, detokenize, emit
```

The scheduler and the output processor own request state; the executor owns the device.

Faults are attributed to requests: sampling, grammar and detokenization errors of one request
fail that request (executor / output processor). If the step itself fails (the forward), each
of its requests is run alone to find the one(s) that fail it; they are failed and the step is
run again without them. A step that still fails fails its own requests, never the others.
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
        if batch:
            try:
                batch, out = self._run(batch)
                if batch:
                    self.scheduler.update(batch, out)
            except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
                logger.exception("engine step failed; failing the requests of that step")
                self.scheduler.fail_batch(batch, f"internal error: {type(exc).__name__}: {exc}")
        return self.processor.drain()

    def _run(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, StepOutput]:
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
        if culprits:
            logger.error("failing %d request(s) whose forward fails: %r", len(culprits), error)
            batch = self.scheduler.without(
                batch, culprits, f"internal error in the forward: {error!r}"
            )
            if not batch:
                return batch, StepOutput([], [])
        return batch, self.executor.run(batch)  # raises again: `step` fails the batch
