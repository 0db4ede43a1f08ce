"""The paged-attention engine.

One concept per module: ``block_pool`` (physical blocks, refcounts, prefix-cache hashes), ``kv_cache`` (block
tables, copy-on-write, forks), ``sequence`` (requests and their samples), ``scheduler`` (what runs each step),
``stop`` (stop rules), ``beam`` (beam-search decisions, transformers' arithmetic), ``model_runner`` (batch
tensors, forward, KV pool sizing), ``swap`` (the CPU swap pool and its block copies), ``sampler`` (logits to tokens), ``llm_engine`` (the ``schedule → run → update`` loop),
``interface`` (the engine as callers see it).
"""
