"""Parquet in and out: reading the input, rows to prompts, part files, the output directory and its manifest."""
