"""Several processes, one per GPU, through torch.distributed: starting them (launch), the control
channel between rank 0 and the others (channel), and the balancing of requests over their engine
replicas (router). The trainer's data parallelism is training/data_parallel.py."""

from .channel import WorkerLink, serve, settle
from .launch import Driver, RankInfo, join
from .router import Router

__all__ = ["Driver", "RankInfo", "Router", "WorkerLink", "join", "serve", "settle"]
