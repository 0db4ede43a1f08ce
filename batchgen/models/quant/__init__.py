"""Checkpoints as users download them: weights held narrower than the arithmetic.

* :mod:`.weight_dtype`: bfloat16 / float16 weights kept in their dtype in memory and computed in float32 on the
  CPU (widened in registers by the GEMM, :mod:`batchgen.kernels.cpu_linear`), natively on a GPU.
"""

from batchgen.models.quant.weight_dtype import activation_dtype, compute_dtype

__all__ = ["activation_dtype", "compute_dtype"]
