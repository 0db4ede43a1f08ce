"""A job over an OpenAI Batch API file: ``data.input=requests.jsonl data.output=results.jsonl``.

1. The request file is parsed (:mod:`batchgen.data.openai_batch`) into ``requests.parquet`` in the bookkeeping
   directory beside the results file (``_results.jsonl.batchgen/``, a name dataset readers skip): the same
   lines always give the same file, so a rerun resumes.
2. An ordinary job runs over it into ``_results.jsonl.batchgen/out/`` (parts, manifest, checkpoints: resumable
   and exactly-once like any job), chat requests through the chat template, each request's parameters as its
   row's sampling overrides; with ``task=embed``, an embedding job over the embeddings requests' inputs.
3. When that job is complete, the results file is written in one atomic step (a rename locally, one PUT on
   an object store): one line per request, in file order. An incomplete job (a signal, exit 75) writes no
   results file; rerunning the same command resumes and then writes it.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.atomic import atomic_write, atomic_write_bytes
from batchgen.data.layout import MANIFEST_NAME, PARTS_NAME
from batchgen.data.manifest import Manifest
from batchgen.data.openai_batch import (
    CHAT_URL,
    TASK_ENDPOINTS,
    BatchRequests,
    parse_requests,
    response_line,
)
from batchgen.data.part_roll import committed_parts
from batchgen.data.storage import Location, is_url
from batchgen.errors import ConfigError
from batchgen.job.config import JobConfig, to_job_config
from batchgen.job.result import EXIT_CONFIG, EXIT_OK, EXIT_TOO_MANY_ERRORS, JobResult

logger = logging.getLogger("batchgen.job")

REQUESTS_NAME = "requests.parquet"


def is_batch_file(spec: Any) -> bool:
    """Whether a ``data.input`` names an OpenAI batch request file (``*.jsonl``)."""
    return str(spec or "").lower().endswith(".jsonl")


def bookkeeping_dir(output: str) -> str:
    """The bookkeeping directory beside the results file `output` (``dir/_results.jsonl.batchgen``)."""
    parent, _, name = str(output).rstrip("/").rpartition("/")
    return f"{parent}/_{name}.batchgen" if parent else f"_{name}.batchgen"


def _lines(spec: str, options: dict[str, Any]) -> Iterator[str]:
    if is_url(spec):
        parent, name = spec.rsplit("/", 1)
        loc = Location(parent, options, key="data.input")
        with loc.open_read(name) as f:
            yield from io.TextIOWrapper(f, encoding="utf-8", errors="replace")
        return
    p = Path(spec).expanduser()
    if not p.is_file():
        raise ConfigError(f"data.input: {spec!r} does not exist (an OpenAI batch request file)")
    with open(p, encoding="utf-8", errors="replace") as f:
        yield from f


def _put(target: str, name: str, data: bytes, options: dict[str, Any]) -> None:
    if is_url(target):
        Location(target, options, key="data.output").put(name, data)
    else:
        Path(target).mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(Path(target) / name, data)


def _get(target: str, name: str, options: dict[str, Any]) -> bytes | None:
    if is_url(target):
        return Location(target, options, key="data.output").read_bytes(name)
    p = Path(target) / name
    return p.read_bytes() if p.is_file() else None


def _derived(cfg: JobConfig, reqs: BatchRequests, book: str) -> JobConfig:
    """The job over the converted requests."""
    if cfg.task == "embed":  # one embedding per request; the file's dimensions are the job's
        data = dataclasses.replace(
            cfg.data, input=f"{book}/{REQUESTS_NAME}", output=f"{book}/out", prompt_column="prompt",
            messages_column=None, id_column=None, keep_columns=[], sampling_column=None, parse_json=False,
        )  # fmt: skip
        dims = reqs.dimensions if reqs.dimensions is not None else cfg.pooling.dimensions
        pooling = dataclasses.replace(cfg.pooling, dimensions=dims)
        run = dataclasses.replace(cfg.run, max_error_fraction=1.0)
        sampling = dataclasses.replace(cfg.sampling, n=1)
        return dataclasses.replace(cfg, data=data, pooling=pooling, run=run, sampling=sampling)
    chat = reqs.endpoint == CHAT_URL
    data = dataclasses.replace(
        cfg.data,
        input=f"{book}/{REQUESTS_NAME}",
        output=f"{book}/out",
        prompt_column="prompt",
        messages_column="messages" if chat else None,
        id_column=None,
        keep_columns=[],
        sampling_column="sampling",
        parse_json=False,
    )
    logprobs = cfg.sampling.logprobs
    if reqs.logprobs and logprobs is None:
        logprobs = 0
    sampling = dataclasses.replace(cfg.sampling, n=reqs.n, logprobs=logprobs)
    # failed requests are result lines, not a sign of an impossible job: the error fraction is checked on the
    # results (run_openai_batch), not by the early stop of a job whose first rows all fail
    run = dataclasses.replace(cfg.run, max_error_fraction=1.0)
    return dataclasses.replace(cfg, data=data, sampling=sampling, run=run)


def _check(job: JobConfig) -> None:
    """Refuse a batch-file job that cannot run (ConfigError naming the key)."""
    d = job.data
    if not str(d.output).lower().endswith(".jsonl"):
        raise ConfigError(
            f"data.input {d.input!r} is an OpenAI batch file: data.output must name the results file "
            "(e.g. data.output=results.jsonl)"
        )
    if d.shard.count != 1:
        raise ConfigError("OpenAI batch files run as one shard: set data.shard.count=1")
    if job.task not in TASK_ENDPOINTS:
        raise ConfigError(
            f"OpenAI batch files run with task=generate (chat / completions) or task=embed (embeddings), "
            f"not task={job.task}"
        )


def run_openai_batch(cfg: Any, run: Callable[[JobConfig], JobResult]) -> JobResult:
    """Run the batch file job described by `cfg` with `run` (:func:`batchgen.job.run.run_job`)."""
    try:
        job = to_job_config(cfg)
        d = job.data
        _check(job)
        opts = dict(d.storage_options)
        reqs = parse_requests(_lines(str(d.input), opts), job.task)
        for msg in reqs.bad_lines:
            logger.warning("%s: %s (written as an error line without custom_id)", d.input, msg)
        book = bookkeeping_dir(d.output)
        buf = io.BytesIO()
        pq.write_table(reqs.table, buf)
        if _get(book, REQUESTS_NAME, opts) != buf.getvalue():
            _put(book, REQUESTS_NAME, buf.getvalue(), opts)
        derived = _derived(job, reqs, book)
    except ConfigError as e:
        logger.error("%s", e)
        return JobResult(EXIT_CONFIG, "error", str(cfg.data.output), None, None, str(e))
    logger.info(
        "%s: %d request(s) to %s (%d that cannot run), bookkeeping in %s",
        d.input, reqs.table.num_rows, reqs.endpoint,
        sum(e is not None for e in reqs.table.column("request_error").to_pylist()), book,
    )  # fmt: skip
    result = run(derived)
    if result.exit_code in (EXIT_OK, EXIT_TOO_MANY_ERRORS):
        try:
            n, errors = write_results(derived, reqs.table, d.output, opts)
        except ConfigError as e:
            logger.error("%s", e)
            return JobResult(EXIT_CONFIG, "error", d.output, result.report_path, result.report, str(e))
        msg = f"{n} result line(s) in {d.output}, {errors} with an error"
        limit = job.run.max_error_fraction
        if n and errors / n > limit:
            msg += (
                f": {errors / n:.1%} of the requests failed, more than run.max_error_fraction={limit:g} "
                f"(exit status {EXIT_TOO_MANY_ERRORS})"
            )
            logger.error("%s", msg)
            return dataclasses.replace(
                result, exit_code=EXIT_TOO_MANY_ERRORS, status="failed", output_dir=d.output, message=msg
            )
        logger.info("%s", msg)
        result = dataclasses.replace(
            result,
            exit_code=EXIT_OK,
            status="complete",
            output_dir=d.output,
            message=f"{result.message}; {msg}",
        )
    return result


def _parts(derived: JobConfig, opts: dict[str, Any]) -> Iterator[pa.Table]:
    out = derived.data.output
    raw = _get(out, MANIFEST_NAME, opts)
    if raw is None:
        raise ConfigError(f"{out}: no manifest; rerun the same command")
    m = Manifest.from_json(raw.decode())
    for part in committed_parts(_get(out, PARTS_NAME, opts), m.windows):
        data = _get(out, part.name, opts)
        if data is None:
            raise ConfigError(f"{out}/{part.name} is missing; rerun the same command")
        yield pq.read_table(io.BytesIO(data))


def _decoder(derived: JobConfig) -> Callable[[int], str] | None:
    if derived.sampling.logprobs is None:
        return None
    from batchgen.job.plan import _model_path
    from batchgen.models.loader import load_tokenizer

    tok = load_tokenizer(_model_path(derived))
    return lambda t: tok.decode([int(t)], skip_special_tokens=False)


def _result_lines(
    derived: JobConfig, requests: pa.Table, opts: dict[str, Any]
) -> Iterator[tuple[bytes, bool]]:
    """Each request's output line, and whether it is an error line."""
    n = derived.sampling.n
    model = derived.model.path or "tiny-default"
    created = int(time.time())
    decode = _decoder(derived)
    reqs = iter(requests.to_pylist())
    for part in _parts(derived, opts):
        rows = part.to_pylist()
        for i in range(0, len(rows), n):
            req = next(reqs)
            line = response_line(req, rows[i : i + n], model, created, decode)
            yield (json.dumps(line, ensure_ascii=False) + "\n").encode(), line["error"] is not None


def write_results(
    derived: JobConfig, requests: pa.Table, output: str, opts: dict[str, Any]
) -> tuple[int, int]:
    """Write the results file from the complete job `derived` (atomically); returns its number of lines and
    of error lines."""
    count = errors = 0
    if is_url(output):
        parent, name = output.rsplit("/", 1)
        chunks = []
        for line, failed in _result_lines(derived, requests, opts):
            chunks.append(line)
            errors += failed
        Location(parent, opts, key="data.output").put(name, b"".join(chunks))
        return len(chunks), errors
    target = Path(output).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(target) as tmp, open(tmp, "wb") as f:
        for line, failed in _result_lines(derived, requests, opts):
            f.write(line)
            count += 1
            errors += failed
    return count, errors
