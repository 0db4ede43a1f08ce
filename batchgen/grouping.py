"""Deprecated import path of prefix grouping and the engine feed loop: use :mod:`batchgen.job.feeder`."""

from batchgen.job.feeder import EngineFeeder, StopFlag, WindowWork, prefix_order

__all__ = ["EngineFeeder", "StopFlag", "WindowWork", "prefix_order"]
