"""A job over several engine replicas (``engine.data_parallel_size > 1`` or ``run.executor=ray``), all in
this package: :mod:`.run` runs the job with the engine loop replaced by a :class:`.coordinator.Coordinator`
(this process: the plan, the output directory, every commit), which sends windows to replicas and takes
their finished requests back; each replica (:mod:`.replica`) drives one engine; the executors start them as
local processes (:mod:`.local`) or Ray actors (:mod:`.ray_actors`).
"""
