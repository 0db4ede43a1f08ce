"""The paged-attention engine.

One concept per module: ``block_pool`` (physical blocks, refcounts, prefix-cache hashes), ``kv_cache`` (block
tables, copy-on-write, forks), ``sequence`` (requests and their samples), ``scheduler`` (what runs each step),
``stop`` (stop rules), ``model_runner`` (batch tensors, forward, KV pool sizing), ``attention`` (the attention
backends), ``sampler`` (logits to tokens), ``llm_engine`` (the ``schedule → run → update`` loop),
``interface`` (the engine as callers see it).
"""
