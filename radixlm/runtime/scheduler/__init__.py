"""The scheduler: `Scheduler` (core.py) composed of admission, pages, retraction, forks and the
token appender; one module each."""

from radixlm.runtime.scheduler.appender import TokenAppender
from radixlm.runtime.scheduler.core import Scheduler, StepStats

__all__ = ["Scheduler", "StepStats", "TokenAppender"]
