"""batchgen on Ray: the job's Ray executor (``run.executor=ray``, :mod:`batchgen.ray.executor`) and
:class:`Generator`, the engine as a callable class for Ray Data's ``map_batches``.

Importing this package does not import Ray (:class:`Generator` needs none); the executor does.
"""

from batchgen.ray.generator import Generator

__all__ = ["Generator"]
