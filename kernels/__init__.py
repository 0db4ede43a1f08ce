"""Paged-attention kernels (installed as ``batchgen.kernels``): a reference, a torch backend, Triton kernels.

Four operations — ``store_kv`` (write the new tokens' K/V into their slots), ``paged_decode_attention`` (one
query per sequence), ``paged_prefill_attention`` (packed query chunks over their cached prefix and themselves)
and ``copy_blocks`` (copy-on-write of whole blocks) — each exist three times, with one name, signature and
semantics:

* :mod:`.reference` *defines* them: naive per-sequence, per-query float64 code that the engine never runs; the
  tests hold both backends to it.
* :mod:`.torch_backend`, the engine's CPU path: gather + SDPA, workspaces, padding buckets, cascade decode;
  its float32 decode on the CPU runs a C kernel that reads blocks in place (:mod:`.cpu_kernel`,
  ``csrc/paged_attention_cpu.c``, compiled on first use; ``BATCHGEN_CPU_KERNEL=0`` turns it off).
* the Triton kernels, the CUDA path, one per module (:mod:`.store_kv`, :mod:`.decode_attention`,
  :mod:`.prefill_attention`, :mod:`.copy_blocks`; the ``@triton.jit`` pieces the attention kernels share are in
  :mod:`._tiles`). These modules import ``triton`` at import time, so import them only where Triton is wanted
  (this package itself imports only torch). Their kernels are compiled for CUDA tensors and run in Triton's
  interpreter for CPU tensors (or whenever ``TRITON_INTERPRET=1``), see :mod:`._jit`.

Also here: :mod:`.testing` (random paged batches for tests and benchmarks), :mod:`.aot` (compile the kernels
for a GPU without one, to check they build and do not spill registers), and the CPU models' other C kernels,
built into the same library as the attention kernel (:mod:`.cpu_kernel`): the float32 linear layer over
weights packed into 16-column panels (:mod:`.cpu_linear`, ``csrc/linear_cpu.c``) and a decoder layer's
elementwise steps — RMSNorm, SiLU·up, RoPE, the KV store (:mod:`.cpu_ops`, ``csrc/layer_ops_cpu.c``). The engine picks a backend in
:mod:`batchgen.attention`.

KV cache layout (the whole engine uses it)
------------------------------------------
One tensor for the model: ``kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``,
contiguous, zero-initialised; index 0 of dim 1 is K, 1 is V. Layer ``i`` works on the two contiguous planes
``k_cache = kv_cache[i, 0]`` and ``v_cache = kv_cache[i, 1]``, each ``[num_blocks, block_size, Hkv, D]``.

* ``head_dim`` is innermost: one token's head vector is ``D`` contiguous elements, so the kernels load K/V
  rows as coalesced ``D``-wide vectors; a block of one kv head is a ``[block_size, D]`` tile with row stride
  ``Hkv * D``. A whole block (all heads) is one contiguous span, so copy-on-write is a flat memcpy per plane.
* Token ``t`` of a sequence is at slot ``block_table[t // block_size] * block_size + t % block_size`` of the
  flattened ``[num_blocks * block_size, Hkv, D]`` plane; slot ``-1`` means "skip" (``store_kv``).
* Block tables are ``[B, max_blocks]`` int32, padded with 0 (padding is never read for real tokens);
  ``seq_lens`` ``[B]`` int32 count cached + new tokens; the attention operations take the two with the layer's
  caches as one :class:`~.paged_kv.PagedKV`. ``cu_seqlens_q`` ``[B+1]`` int32 delimit the packed
  queries. Block sizes 8, 16, 32 and 64 are supported; head sizes need not be powers of two (64, 80, 96, 128,
  256 are tested).
* GQA: query head ``h`` reads kv head ``h // (Hq // Hkv)``. Scores, softmax and accumulation are float32;
  outputs have the query's dtype. Caches may be float16, bfloat16 or float32.

Attention options
-----------------
Both attention operations of every implementation take one :class:`~.options.AttentionOptions` (in the
place a ``scale`` would stand): the ``scale``, and optional ``sliding_window`` (a query at position ``p`` sees
keys ``p - sliding_window < k <= p``: transformers' convention), ``softcap`` (logits become
``softcap * tanh(logits / softcap)``, Gemma 2) and ``sinks`` (``[Hq]``, one extra logit per head in the softmax
denominator, gpt-oss); ``None`` = plain causal attention. See :mod:`.reference`. Under a window, no
implementation reads a block-table entry of a block that lies wholly before the window of every query of its
sequence (a query chunk's first query has the earliest window): a cache manager may free such blocks and leave
anything in those entries. Entries past a sequence's last block (padding) must still be valid block ids.
"""

if __name__ == "kernels":
    # This folder reached as a top-level ``kernels`` rather than as ``batchgen.kernels``: a checkout's root is on
    # sys.path (the current directory of ``python -c``, the driver's directory Ray adds to its workers). An
    # installed ``kernels`` distribution (Hugging Face's, which transformers imports) takes the name instead, so
    # a checkout never shadows it; without one this stays an empty module, which transformers reads as absent.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _elsewhere = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _checkout]
    _spec = _machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None:
        _installed = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = (
            _installed  # the import system hands out what sys.modules holds after this runs
        )
        _spec.loader.exec_module(_installed)
else:
    from .options import AttentionOptions
    from .paged_kv import PagedKV
    from .torch_backend import Workspace

__all__ = ["AttentionOptions", "PagedKV", "Workspace", "triton_available"]


def triton_available() -> bool:
    """Whether the Triton kernels can be imported (Triton installed and importable)."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install raising something else
        return False
    return True
