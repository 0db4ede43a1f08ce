"""The paged-attention engine, in folders by role.

* ``config`` — :class:`EngineConfig`, the engine's options.
* ``core`` — the ``schedule → execute → update`` loop (``llm_engine`` and its pipelined subclass), the engine
  as callers see it (``interface``), request outputs (``outputs``, ``output_processor``) and figures
  (``stats``).
* ``sched`` — what runs each step: requests and sequences (``sequence``), request groups and add-ons, the
  features' hooks (``request_group``, one kind per request: ``kinds``), the scheduler and its output
  (``scheduler``, ``output``, and its pipelined subclass), stop rules (``stop``, ``detokenizer``).
* ``kv`` — KV memory: the block pool, block tables, the KV cache manager, prefix reuse at admission and the CPU
  swap space.
* ``worker`` — what runs a step: the plain step input and its builder, the executor, the model runner and its
  input batch, the sampler, tensor parallelism.
* ``features`` — one file per feature: its group kind or request add-on, its state and its pieces of a step.
"""
