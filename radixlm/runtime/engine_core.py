"""EngineCore: one engine step, on the engine's loop thread.

```
batch = scheduler.schedule()          # admit (LPM + aging), chunk prefill, decode, retract, fork
out   = executor.run(batch)           # forward + masks + sampling: StepOutput
scheduler.update(batch, out)          # tokens appended, pages inserted into the radix tree
processor.drain()                     # stop strings, detokenize, emit
```

The scheduler and the output processor own request state; the executor owns the device.
"""

from __future__ import annotations

from radixlm.runtime.executor import Executor
from radixlm.runtime.output_processor import OutputProcessor
from radixlm.runtime.request import RequestOutput
from radixlm.runtime.scheduler import Scheduler


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, processor: OutputProcessor):
        self.scheduler = scheduler
        self.executor = executor
        self.processor = processor

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch:
            out = self.executor.run(batch)
            self.scheduler.update(batch, out)
        return self.processor.drain()
