"""Keep Python's cyclic garbage collector off the heap that exists before the first engine is built.

A full (oldest-generation) collection traverses every object the collector tracks: once torch, transformers and
batchgen are imported that is about 200,000 objects, 90 ms on the benchmark VM. The scheduler allocates per
sequence every step (its step records, block-table copies, output entries), so the collector's full passes fall
inside steps: at 512 running sequences they doubled the scheduling time per step. :func:`freeze_startup_heap`
collects the young generations (under a millisecond; a full pass would add a tenth of a second to every start,
for a few dozen garbage objects) and moves every object alive at that moment into the permanent generation
(``gc.freeze``), once per process, before the first engine loads its model; later collections traverse only what
was made since (engines, requests, results).

Invariant: a frozen object is still freed by reference counting, but never as part of cyclic garbage, so what is
frozen is the import-time heap and what the caller held when it built its first engine, never an engine (its
model, KV pool and requests are made after the freeze). At exit the heap is unfrozen again, so the interpreter's
shutdown reclaims it as usual (nanobind-based extensions such as Triton report objects left alive then as leaks).
No-op when ``BATCHGEN_GC_FREEZE=0``.
"""

from __future__ import annotations

import atexit
import gc
import os

_done = False


def freeze_startup_heap() -> bool:
    """Collect the young generations, then freeze every tracked object, once per process; True when this call
    froze them."""
    global _done
    if _done:
        return False
    _done = True
    if os.environ.get("BATCHGEN_GC_FREEZE", "1") == "0":
        return False
    gc.collect(1)
    gc.freeze()
    atexit.register(gc.unfreeze)  # shutdown collects them again (extension modules check for leaks)
    return True
