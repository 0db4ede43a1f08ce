"""Checkpoints as users download them: weights held narrower than the arithmetic.

* :mod:`.weight_dtype`: bfloat16 / float16 weights kept in their dtype in memory and computed in float32 on the
  CPU (widened in registers by the GEMM, :mod:`batchgen.kernels.cpu_linear`), natively on a GPU.
* :mod:`.gguf_checkpoint`, :mod:`.quant_linear`: GGUF files, their block formats kept packed.
* :mod:`.compressed_tensors`: a checkpoint's ``quantization_config`` read into a scheme (or refused by name);
  pack-quantized integer weights.
* :mod:`.gptq_awq`, :mod:`.group_linear`: GPTQ and AWQ repacked at load for the integer GEMM.
* :mod:`.fp8`: fp8 weights (compressed-tensors float-quantized, fine-grained block fp8).
* :mod:`.linear_loader`: quantized projections read before the float tensors; :mod:`.kv_scales`: fp8 KV-cache
  scales. :mod:`.writers`: the formats written from their specifications (test and benchmark fixtures).
"""

from batchgen.models.quant.weight_dtype import activation_dtype, compute_dtype

__all__ = ["activation_dtype", "compute_dtype"]
