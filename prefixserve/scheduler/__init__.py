from prefixserve.scheduler.config import SchedulerConfig
from prefixserve.scheduler.output import ScheduledSequence, SchedulerOutput
from prefixserve.scheduler.request import Request, RequestStatus, child_request_id
from prefixserve.scheduler.scheduler import Scheduler, SchedulerStats

__all__ = ["Request", "RequestStatus", "ScheduledSequence", "Scheduler", "SchedulerConfig", "SchedulerOutput",
           "SchedulerStats", "child_request_id"]
