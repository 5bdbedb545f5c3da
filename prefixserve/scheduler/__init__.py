from prefixserve.scheduler.config import SchedulerConfig
from prefixserve.scheduler.output import ScheduledSequence, SchedulerOutput
from prefixserve.scheduler.request import Request, RequestStatus
from prefixserve.scheduler.scheduler import QueueFull, RequestRejected, Scheduler, SchedulerStats

__all__ = ["QueueFull", "Request", "RequestRejected", "RequestStatus", "ScheduledSequence",
           "Scheduler", "SchedulerConfig", "SchedulerOutput", "SchedulerStats"]
