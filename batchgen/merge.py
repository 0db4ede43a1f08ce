"""``batchgen-merge`` (the console script ``batchgen.merge:main``, also ``python -m batchgen.merge``).

The command lives in :mod:`batchgen.job.merge_cli`, the checks in :mod:`batchgen.job.merge`; this module
keeps the entry point and the former import path.
"""

from batchgen.job.merge import MergeReport, Problem, input_ids, verify, write_merged
from batchgen.job.merge_cli import EXIT_ERROR, EXIT_INCOMPLETE, EXIT_OK, build_parser, format_report, main
from batchgen.job.shards import MergeError, PartRef, Shard, find_shards

__all__ = [
    "EXIT_ERROR",
    "EXIT_INCOMPLETE",
    "EXIT_OK",
    "MergeError",
    "MergeReport",
    "PartRef",
    "Problem",
    "Shard",
    "build_parser",
    "find_shards",
    "format_report",
    "input_ids",
    "main",
    "verify",
    "write_merged",
]

if __name__ == "__main__":
    main()
