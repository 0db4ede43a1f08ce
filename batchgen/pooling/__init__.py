"""Pooling tasks: embeddings (last / mean / CLS pooling, normalisation, Matryoshka ``dimensions``) and
classification or reward heads, for decoder checkpoints (native code over the paged engine, prefill only) and
encoder checkpoints (transformers' modeling code, length-bucketed unpadded batches).

``batchgen.LLM(path).embed(texts)`` / ``.classify(texts)`` and the job's ``task=embed`` / ``task=classify``
use it; :mod:`.checkpoint` reads what a checkpoint says about pooling (sentence-transformers modules, heads,
labels) and which task it is for.
"""
