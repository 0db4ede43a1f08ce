"""Process-level utilities every layer may use (they import nothing else of batchgen's): atomic file writes,
the on-disk cache, CPU thread policy, the allocator's tuning and the start-up trace."""
