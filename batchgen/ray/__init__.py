"""batchgen on Ray Data: :class:`Generator`, the engine as a callable class for ``map_batches``. (The job's Ray
executor, ``run.executor=ray``, is :mod:`batchgen.job.replicas.ray_actors`.)

Importing this package does not import Ray (:class:`Generator` needs none).
"""

from batchgen.ray.generator import Generator

__all__ = ["Generator"]
