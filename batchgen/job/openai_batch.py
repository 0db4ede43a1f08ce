"""A job over an OpenAI Batch API file: ``data.input=requests.jsonl data.output=results.jsonl``.

1. The request file is parsed (:mod:`batchgen.data.openai_batch`) into ``requests.parquet`` in the bookkeeping
   directory beside the results file (``_results.jsonl.batchgen/``, a name dataset readers skip): the same
   lines always give the same file, so a rerun resumes.
2. An ordinary job runs over it (the job runner runs it like any other: this module only adapts its input
   and output, :class:`BatchFile`) into ``_results.jsonl.batchgen/out/`` (parts, manifest, checkpoints: resumable
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

from batchgen.data.layout import MANIFEST_NAME
from batchgen.data.manifest import Manifest
from batchgen.data.openai_batch import (
    CHAT_URL,
    TASK_ENDPOINTS,
    BatchRequests,
    group_samples,
    parse_requests,
    response_line,
)
from batchgen.data.storage import Location, is_url
from batchgen.errors import ConfigError
from batchgen.job.config import JobConfig, to_job_config
from batchgen.job.result import EXIT_CONFIG, EXIT_OK, EXIT_TOO_MANY_ERRORS, JobResult
from batchgen.job.tally import RowTally
from batchgen.runtime.atomic import atomic_write, atomic_write_bytes, remove_stale_temps

logger = logging.getLogger("batchgen.job")

REQUESTS_NAME = "requests.parquet"


def is_batch_file(spec: Any) -> bool:
    """Whether a ``data.input`` names an OpenAI batch request file (``*.jsonl``)."""
    return str(spec or "").lower().endswith(".jsonl")


def is_batch_requests(spec: Any) -> bool:
    """Whether a ``data.input`` is the requests a batch file's job reads (its bookkeeping directory's
    ``requests.parquet``)."""
    parent, _, name = str(spec or "").rstrip("/").rpartition("/")
    return name == REQUESTS_NAME and parent.endswith(".batchgen")


def bookkeeping_dir(output: str) -> str:
    """The bookkeeping directory beside the results file `output` (``dir/_results.jsonl.batchgen``)."""
    parent, _, name = str(output).rstrip("/").rpartition("/")
    return f"{parent}/_{name}.batchgen" if parent else f"_{name}.batchgen"


def _lines(spec: str, options: dict[str, Any]) -> Iterator[str]:
    if is_url(spec):
        parent, name = spec.rsplit("/", 1)
        loc = Location(parent, options, key="data.input")
        with loc.open_read(name) as f:
            yield from io.TextIOWrapper(f, encoding="utf-8", errors="surrogateescape")
        return
    p = Path(spec).expanduser()
    if not p.is_file():
        raise ConfigError(f"data.input: {spec!r} does not exist (an OpenAI batch request file)")
    with open(p, encoding="utf-8", errors="surrogateescape") as f:  # bad bytes: error lines
        yield from f


def _put(target: str, name: str, data: bytes, options: dict[str, Any]) -> None:
    if is_url(target):
        Location(target, options, key="data.output").put(name, data)
    else:
        Path(target).mkdir(parents=True, exist_ok=True)
        remove_stale_temps(Path(target) / name)  # a run killed while writing it left its temporary file
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
    sampling = dataclasses.replace(cfg.sampling, n=1, logprobs=logprobs)  # a row per sample (parse_requests)
    # failed requests are result lines, not a sign of an impossible job: the error fraction is checked on the
    # results (BatchFile.results), not by the early stop of a job whose first rows all fail
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


@dataclasses.dataclass(frozen=True)
class BatchFile:
    """An OpenAI batch request file as a job's input and output adapter: :func:`open_batch_file` converts the
    requests (input) and gives the ordinary job to run (``job``); :meth:`results` writes the results file from
    that job's output once it is complete (output)."""

    requested: JobConfig
    """The configuration as given (``data.input`` the request file, ``data.output`` the results file)."""
    requests: BatchRequests
    job: JobConfig
    """The job over the converted requests (its output in the bookkeeping directory)."""

    def results(self, result: JobResult, print_summary: bool = False) -> JobResult:
        """The batch file's result from the job's ``result``: the results file written when the job is
        complete (exit 0, or 3 with too many error rows: failed requests are result lines), its error
        fraction checked against ``run.max_error_fraction``; with `print_summary`, the summary table printed once
        the results file is written, its error counts those of the result lines; any other result (a dry run's
        plan, a failed or stopped job) as it is."""
        if result.status == "planned":  # a dry run plans the job over the requests: no results file
            self._plan_in_request_terms(print_summary)
            return result
        if result.exit_code not in (EXIT_OK, EXIT_TOO_MANY_ERRORS):
            return result
        d = self.requested.data
        try:
            n, tally = write_results(self.job, self.requests.table, d.output, dict(d.storage_options))
        except ConfigError as e:
            logger.error("%s", e)
            return JobResult(EXIT_CONFIG, "error", d.output, result.report_path, result.report, str(e))
        errors = sum(tally.errors.values())
        msg = f"{n} result line(s) in {d.output}, {errors} with an error"
        limit = self.requested.run.max_error_fraction
        if n and errors / n > limit:
            msg += (
                f": {errors / n:.1%} of the requests failed, more than run.max_error_fraction={limit:g} "
                f"(exit status {EXIT_TOO_MANY_ERRORS})"
            )
            logger.error("%s", msg)
            if print_summary:
                _print_summary(result, tally, n, limit, msg)
            return dataclasses.replace(
                result, exit_code=EXIT_TOO_MANY_ERRORS, status="failed", output_dir=d.output, message=msg
            )
        logger.info("%s", msg)
        if print_summary:
            _print_summary(result, tally, n, limit, msg)
        return dataclasses.replace(
            result,
            exit_code=EXIT_OK,
            status="complete",
            output_dir=d.output,
            message=f"{result.message}; {msg}",
        )

    def _plan_in_request_terms(self, print_summary: bool) -> None:
        """Rewrite the dry run's ``_plan.json`` (in the bookkeeping directory's ``out/``) in the request file's
        terms: a request that cannot run counts under its own reason (the results file's), not as the empty row
        the job runs for it, and each reason's first ids are custom_ids (``line N`` for a line without one);
        then print it (with ``print_summary``)."""
        from batchgen.job.dry_run import NUM_ERROR_IDS
        from batchgen.job.plan_report import PLAN_NAME, format_plan
        from batchgen.job.tally import error_key

        out, opts = self.job.data.output, dict(self.job.data.storage_options)
        raw = _get(out, PLAN_NAME, opts)
        if raw is None:
            return
        plan = json.loads(raw.decode())
        t = self.requests.table
        cids, lines = t.column("custom_id").to_pylist(), t.column("line").to_pylist()
        req_errors = t.column("request_error").to_pylist()

        def name(i: Any) -> Any:
            if not isinstance(i, int) or not 0 <= i < len(cids):
                return i
            return cids[i] if cids[i] is not None else f"line {lines[i]}"

        # a request that cannot run is a row without prompt and messages: the job's "... is null" errors
        errors = {k: {**e, "first_ids": [name(i) for i in e["first_ids"]]}
                  for k, e in (plan.get("errors") or {}).items() if not k.endswith(" is null")}  # fmt: skip
        for i, reason in enumerate(req_errors):
            if reason is None:
                continue
            e = errors.setdefault(error_key(reason), {"rows": 0, "example": reason, "first_ids": []})
            e["rows"] += 1
            if len(e["first_ids"]) < NUM_ERROR_IDS:
                e["first_ids"].append(name(i))
        plan["errors"] = dict(sorted(errors.items(), key=lambda kv: -kv[1]["rows"]))
        _put(out, PLAN_NAME, (json.dumps(plan, indent=1, default=str) + "\n").encode(), opts)
        if print_summary:
            print(format_plan(plan))
            print(f"dry run: plan written to {out}/{PLAN_NAME} (nothing else was written)")


def open_batch_file(cfg: Any) -> BatchFile:
    """Parse the request file of `cfg` and stage it as ``requests.parquet`` in the bookkeeping directory
    (rewritten only when it changed, so a rerun resumes); raises ConfigError for a job that cannot run."""
    job = to_job_config(cfg)
    d = job.data
    _check(job)
    opts = dict(d.storage_options)
    reqs = parse_requests(_lines(str(d.input), opts), job.task, n=job.sampling.n)
    for msg in reqs.bad_lines:
        logger.warning("%s: %s (written as an error line without custom_id)", d.input, msg)
    book = bookkeeping_dir(d.output)
    buf = io.BytesIO()
    pq.write_table(reqs.table, buf)
    if _get(book, REQUESTS_NAME, opts) != buf.getvalue():
        _put(book, REQUESTS_NAME, buf.getvalue(), opts)
    first = [k == 0 for k in reqs.table.column("sample_index").to_pylist()]
    errors = reqs.table.column("request_error").to_pylist()
    logger.info(
        "%s: %d request(s) to %s (%d that cannot run, %d sample row(s) in all), bookkeeping in %s",
        d.input, sum(first), reqs.endpoint, sum(e is not None for e in errors), reqs.table.num_rows, book,
    )  # fmt: skip
    return BatchFile(job, reqs, _derived(job, reqs, book))


def _print_summary(result: JobResult, tally: RowTally, lines: int, limit: float, msg: str) -> None:
    """The job's summary table with the results file's error figures (the most common reasons of its error
    lines, their fraction against run.max_error_fraction), then `msg`."""
    from batchgen.job.report import format_table

    if result.report is not None:
        errors = sum(tally.errors.values())
        frac = errors / lines if lines else 0.0
        top = [(tally.error_examples[k], c) for k, c in tally.errors.most_common(3)]
        report = {
            **result.report,
            "errors": {"fraction": frac, "max_fraction": limit, "exceeded": frac > limit, "top": top},
        }
        if frac > limit:
            report["status"] = "failed"
        print(format_table(report))
    print(msg)


def _parts(derived: JobConfig, opts: dict[str, Any]) -> Iterator[pa.Table]:
    out = derived.data.output
    raw = _get(out, MANIFEST_NAME, opts)
    if raw is None:
        raise ConfigError(f"{out}: no manifest; rerun the same command")
    m = Manifest.from_json(raw.decode())
    for part in m.parts:  # the rolled parts, in input order
        data = _get(out, part.name, opts)
        if data is None:
            raise ConfigError(f"{out}/{part.name} is missing; rerun the same command")
        yield pq.read_table(io.BytesIO(data))


def _decoder(derived: JobConfig) -> Callable[[int], str] | None:
    if derived.sampling.logprobs is None:
        return None
    from batchgen.job.plan import _model_path
    from batchgen.models.loader import load_tokenizer

    tok = load_tokenizer(_model_path(derived.model.path, derived.model.gguf_file))
    return lambda t: tok.decode([int(t)], skip_special_tokens=False)


def _result_lines(
    derived: JobConfig, requests: pa.Table, opts: dict[str, Any]
) -> Iterator[tuple[bytes, str | None]]:
    """Each request's output line (its sample rows' outputs as its choices), and its error message (None for
    a response line)."""
    model = derived.model.path or "tiny-default"
    created = int(time.time())
    decode = _decoder(derived)
    reqs = iter(requests.to_pylist())

    def rows() -> Iterator[dict[str, Any]]:
        for part in _parts(derived, opts):
            for out in part.to_pylist():  # one output row per sample row, in the same order
                yield {**next(reqs), "_output": out}

    for group in group_samples(rows()):
        line = response_line(group[0], [g["_output"] for g in group], model, created, decode)
        error = line["error"]
        yield (
            (json.dumps(line, ensure_ascii=False) + "\n").encode(),
            None if error is None else str(error["message"]),
        )


def write_results(
    derived: JobConfig, requests: pa.Table, output: str, opts: dict[str, Any]
) -> tuple[int, RowTally]:
    """Write the results file from the complete job `derived` (atomically); returns its number of lines and
    the tally of its error lines by reason."""
    count = 0
    tally = RowTally()
    if is_url(output):
        parent, name = output.rsplit("/", 1)
        chunks = []
        for line, error in _result_lines(derived, requests, opts):
            chunks.append(line)
            tally.count(error is None, error)
        Location(parent, opts, key="data.output").put(name, b"".join(chunks))
        return len(chunks), tally
    target = Path(output).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(target)  # a run killed while writing it left its temporary file
    with atomic_write(target) as tmp, open(tmp, "wb") as f:
        for line, error in _result_lines(derived, requests, opts):
            f.write(line)
            count += 1
            tally.count(error is None, error)
    return count, tally
