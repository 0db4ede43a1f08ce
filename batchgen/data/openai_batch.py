"""OpenAI Batch API files: request lines → job rows, output rows → response lines.

Input: one JSON object per line, ``{custom_id, method: POST, url, body}`` with ``url`` ``/v1/chat/completions``
(``body.messages`` through the chat template) or ``/v1/completions`` (``body.prompt``) for a generation job, or
``/v1/embeddings`` (``body.input``: a string or a list of one string; ``dimensions``; ``encoding_format``
``float`` or ``base64``) for a ``task=embed`` job. A line for an endpoint the job's task does not serve is an
error line. Invariants:
- Every line becomes one row per sample (``n`` rows, ``sample_index`` 0..n-1, consecutive, in file order) and
  later exactly one output line whose ``choices`` hold the ``n`` samples (``choices[i].index == i``): a request
  that cannot run (not JSON, unsupported endpoint or parameter, a bad body, a duplicate ``custom_id``) is one
  row carrying its ``request_error``, written as a line with ``error`` set. A line that is not JSON has no
  ``custom_id``; its error names its line number.
- Sampling fields map onto :class:`~batchgen.sampling_params.SamplingParams` per row (a JSON ``sampling``
  column): ``max_tokens``/``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``,
  ``presence_penalty``, ``frequency_penalty``, ``logprobs``/``top_logprobs``, ``response_format``
  (``json_schema`` → its schema, ``json_object`` → any JSON object) → structured outputs. ``n`` (1 to
  :data:`MAX_N`) is per request, the job's ``sampling.n`` for a request that gives none; a seeded request's
  sample ``i > 0`` runs with the seed the engine gives sample ``i`` of an ``n``-sample request
  (:func:`~batchgen.engine.sched.sequence.sample_seed`), so its samples differ and are reproducible. An
  embeddings request's ``dimensions`` is one value per file (the job's ``pooling.dimensions``).
- Output bodies are ``chat.completion`` / ``text_completion`` objects whose ids derive from the ``custom_id``
  and the line, so writing the file again (a resumed job) gives the same ids; an embeddings request's body is
  OpenAI's embeddings response (``{"object": "list", "data": [{"object": "embedding", "index": 0,
  "embedding": [...]}], "model", "usage"}``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from batchgen.data.json_limits import JsonLimitError, loads_bounded
from batchgen.engine.sched.sequence import sample_seed

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
ENDPOINTS = (CHAT_URL, COMPLETIONS_URL)
TASK_ENDPOINTS = {"generate": ENDPOINTS, "embed": (EMBEDDINGS_URL,)}
"""The endpoints a job of each task serves."""
_ENCODINGS = ("float", "base64")
MAX_N = 128
"""Most samples one request may ask for (OpenAI's limit)."""

_SAMPLING_KEYS = {"temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty"}
_IGNORED = {"model", "user", "metadata", "store", "stream", "stream_options", "service_tier", "n",
            "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "response_format", "messages",
            "prompt", "parallel_tool_calls", "reasoning_effort"}  # fmt: skip
_UNSUPPORTED = {"tools", "tool_choice", "functions", "function_call", "logit_bias", "audio", "modalities",
                "prediction", "suffix", "echo", "best_of", "web_search_options"}  # fmt: skip

REQUEST_SCHEMA = pa.schema(
    [
        ("custom_id", pa.string()),
        ("line", pa.int64()),
        ("n", pa.int32()),
        ("sample_index", pa.int32()),
        ("endpoint", pa.string()),
        ("model", pa.string()),
        ("prompt", pa.string()),
        ("messages", pa.string()),
        ("sampling", pa.string()),
        ("top_logprobs", pa.int32()),
        ("encoding_format", pa.string()),
        ("request_error", pa.string()),
    ]
)
"""The rows a request file becomes, one per sample (``messages`` and ``sampling`` as JSON text)."""


@dataclass
class BatchRequests:
    """A parsed request file: its rows (:data:`REQUEST_SCHEMA`, one per sample), the endpoint it runs, whether
    any request asks for logprobs, and its embeddings' ``dimensions`` (None: the model's size)."""

    table: pa.Table
    endpoint: str
    logprobs: bool = False
    bad_lines: list[str] = field(default_factory=list)
    dimensions: int | None = None


class _Bad(ValueError):
    """A request that cannot run: its error message."""


def _int(body: dict, key: str, lo: int = 0) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _Bad(f"body.{key} must be an integer >= {lo}, got {v!r}")
    return v


def _sampling(body: dict, chat: bool) -> tuple[dict[str, Any], int | None]:
    """The per-row SamplingParams overrides of a request body, and its top_logprobs (None: no logprobs)."""
    bad = sorted(k for k in body if k in _UNSUPPORTED)
    if bad:
        raise _Bad(f"unsupported parameter {bad[0]!r}")
    out: dict[str, Any] = {k: body[k] for k in _SAMPLING_KEYS if body.get(k) is not None}
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    for k in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        if k in out and (isinstance(out[k], bool) or not isinstance(out[k], (int, float))):
            raise _Bad(f"body.{k} must be a number, got {out[k]!r}")
    if "temperature" in out and out["temperature"] < 0:
        raise _Bad(f"body.temperature must be >= 0, got {out['temperature']!r}")
    if "seed" in out:
        _int(body, "seed", lo=-(1 << 63))
    mt = _int(body, "max_completion_tokens", 1) if chat else None
    mt = mt if mt is not None else _int(body, "max_tokens", 1)
    if mt is not None:
        out["max_tokens"] = mt
    top: int | None = None
    if chat:
        if body.get("logprobs"):
            top = _int(body, "top_logprobs") or 0
        elif body.get("top_logprobs") is not None:
            raise _Bad("body.top_logprobs needs body.logprobs=true")
    else:
        top = _int(body, "logprobs")
    if top is not None:
        if top > 20:
            raise _Bad(f"top_logprobs/logprobs must be <= 20, got {top}")
        out["logprobs"] = top
    rf = body.get("response_format")
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "json_schema":
            schema = (
                (rf.get("json_schema") or {}).get("schema")
                if isinstance(rf.get("json_schema"), dict)
                else None
            )
            if not isinstance(schema, dict):
                raise _Bad("response_format.json_schema.schema must be a JSON schema object")
            out["json_schema"] = schema
        elif kind == "json_object":
            out["json_schema"] = {"type": "object"}
        elif kind != "text":
            raise _Bad(f"unsupported response_format type {kind!r} (json_schema, json_object or text)")
    return out, top


def _embedding_body(body: dict, row: dict[str, Any]) -> None:
    """An embeddings request's ``input``, ``dimensions`` and ``encoding_format`` into ``row``."""
    inp = body.get("input")
    if isinstance(inp, list) and len(inp) == 1 and isinstance(inp[0], str):
        inp = inp[0]
    if not isinstance(inp, str):
        raise _Bad(
            "body.input must be a string or a list of one string (token ids and several inputs per request are "
            "not supported: write one request per input)"
        )
    if not inp:
        raise _Bad("body.input must not be empty")
    fmt = body.get("encoding_format") or "float"
    if fmt not in _ENCODINGS:
        raise _Bad(f"body.encoding_format must be 'float' or 'base64', got {fmt!r}")
    row["prompt"], row["encoding_format"] = inp, fmt
    row["dimensions"] = _int(body, "dimensions", 1)


_CUSTOM_ID_RE = re.compile(r'"custom_id"\s*:\s*("(?:[^"\\]|\\.)*")')


def _printable_custom_id(text: str) -> str | None:
    """The custom_id of a line refused as a whole (too deep, too large, invalid UTF-8, a lone surrogate), made
    printable (``\\udcff`` escapes), so its error line still names the request; None when none is found."""
    m = _CUSTOM_ID_RE.search(text)
    try:
        cid = json.loads(m.group(1)) if m else None
    except ValueError:
        return None
    return cid.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(cid, str) and cid else None


def _parse_line(text: str, lineno: int, endpoint: str | None, task: str = "generate") -> dict[str, Any]:
    """One request line as a row (``request_error`` set when it cannot run)."""
    row: dict[str, Any] = {"line": lineno}
    try:
        req = loads_bounded(text)
    except JsonLimitError as e:
        row["request_error"] = f"line {lineno}: {e}"
        row["custom_id"] = _printable_custom_id(text)
        return row
    except json.JSONDecodeError as e:
        row["request_error"] = f"line {lineno}: not valid JSON ({e.msg} at column {e.colno})"
        return row
    if not isinstance(req, dict):
        row["request_error"] = f"line {lineno}: a request must be a JSON object"
        return row
    cid = req.get("custom_id")
    row["custom_id"] = cid if isinstance(cid, str) else (None if cid is None else json.dumps(cid))
    try:
        if not isinstance(cid, str) or not cid:
            raise _Bad("custom_id must be a non-empty string")
        if str(req.get("method", "POST")).upper() != "POST":
            raise _Bad(f"unsupported method {req.get('method')!r} (POST)")
        url = req.get("url")
        row["endpoint"] = url
        served = TASK_ENDPOINTS.get(task, ())
        if url not in (*ENDPOINTS, EMBEDDINGS_URL):
            raise _Bad(f"unsupported endpoint {url!r} ({CHAT_URL}, {COMPLETIONS_URL} or {EMBEDDINGS_URL})")
        if url not in served:
            need = "task=embed" if url == EMBEDDINGS_URL else "task=generate"
            raise _Bad(f"endpoint {url} needs a job with {need}; this job has task={task}")
        if endpoint is not None and url != endpoint:
            raise _Bad(f"endpoint {url} differs from the file's {endpoint}: one endpoint per batch file")
        body = req.get("body")
        if not isinstance(body, dict):
            raise _Bad("body must be a JSON object")
        row["model"] = body.get("model") if isinstance(body.get("model"), str) else None
        if url == EMBEDDINGS_URL:
            _embedding_body(body, row)
            return row
        chat = url == CHAT_URL
        if chat:
            if "messages" not in body:
                raise _Bad("body.messages is required")
            row["messages"] = json.dumps(body["messages"])
        else:
            p = body.get("prompt")
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
                p = p[0]
            if not isinstance(p, str):
                raise _Bad("body.prompt must be a string (lists of prompts and token ids are not supported)")
            row["prompt"] = p
        sampling, top = _sampling(body, chat)
        row["sampling"] = json.dumps(sampling, sort_keys=True)
        row["top_logprobs"] = top
        row["n"] = _int(body, "n", 1)
        if row["n"] is not None and row["n"] > MAX_N:
            raise _Bad(f"body.n must be at most {MAX_N}, got {row['n']}")
    except _Bad as e:
        row["request_error"] = str(e)
    return row


def _samples(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A request's rows, one per sample (an error row, or an embeddings request: one)."""
    if row.get("request_error") is not None or row.get("sampling") is None:
        return [{**row, "n": 1, "sample_index": 0}]
    n, sampling = row["n"], json.loads(row["sampling"])
    out = []
    for k in range(n):
        s = sampling
        if k and sampling.get("seed") is not None:
            s = {**sampling, "seed": sample_seed(int(sampling["seed"]), k)}
        out.append(
            {**row, "sample_index": k, "sampling": json.dumps(s, sort_keys=True) if k else row["sampling"]}
        )
    return out


def parse_requests(lines: Iterable[str], task: str = "generate", n: int = 1) -> BatchRequests:
    """Rows of a request file (its lines, in order) for a job of ``task``, ``n`` samples for a request that
    gives no ``n``; see the module docstring."""
    rows: list[dict[str, Any]] = []
    endpoint: str | None = None
    seen: set[str] = set()
    for lineno, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        row = _parse_line(text, lineno, endpoint, task)
        if row.get("request_error") is None:
            endpoint = endpoint or row["endpoint"]
            if row["custom_id"] in seen:
                row["request_error"] = f"duplicate custom_id {row['custom_id']!r} (line {lineno})"
            seen.add(row["custom_id"])
        rows.append(row)
    dims = next((r.get("dimensions") for r in rows if r.get("request_error") is None), None)
    for r in rows:
        if r.get("n") is None:
            r["n"] = n
        if r.get("request_error") is None and r.get("dimensions") != dims:
            r["request_error"] = (
                f"dimensions={r.get('dimensions')} differs from the file's dimensions={dims}: one dimensions "
                "per batch file"
            )
    for r in rows:
        if r.get("request_error") is not None:  # an error row runs nothing
            r["prompt"], r["messages"], r["sampling"] = None, None, None
    logprobs = any(r.get("top_logprobs") is not None for r in rows if r.get("request_error") is None)
    table = pa.Table.from_pylist(
        [{k: s.get(k) for k in REQUEST_SCHEMA.names} for r in rows for s in _samples(r)],
        schema=REQUEST_SCHEMA,
    )
    bad = [r["request_error"] for r in rows if r.get("custom_id") is None and r.get("request_error")]
    default = TASK_ENDPOINTS.get(task, ENDPOINTS)[0]
    return BatchRequests(table, endpoint or default, logprobs, bad, dims)


def group_samples(rows: Iterable[dict[str, Any]]) -> Iterable[list[dict[str, Any]]]:
    """Consecutive rows of one request (one per sample, the request's ``n``) as lists, in file order; each
    row may carry its output fields (a row of the request table zipped with the job's output row)."""
    group: list[dict[str, Any]] = []
    for r in rows:
        group.append(r)
        if len(group) == (r.get("n") or 1):  # an error row is one row (n=1)
            yield group
            group = []
    if group:
        raise ValueError(f"line {group[0]['line']}: {len(group)} of its {group[0]['n']} sample rows")


# ---------------------------------------------------------------------------------------------- output
def _ident(prefix: str, *parts: Any) -> str:
    return prefix + hashlib.sha256("\0".join(str(p) for p in parts).encode()).hexdigest()[:24]


_FINISH = {"stop": "stop", "length": "length"}


def _chat_logprobs(
    token_ids: list[int], lps: list[dict[int, float]], top: int, decode: Any
) -> dict[str, Any]:
    content = []
    for tok, d in zip(token_ids, lps):
        s = decode(tok)
        alts = sorted(d.items(), key=lambda kv: -kv[1])[:top]
        content.append(
            {
                "token": s,
                "logprob": float(d.get(tok, float("nan"))),
                "bytes": list(s.encode()),
                "top_logprobs": [
                    {"token": decode(t), "logprob": float(v), "bytes": list(decode(t).encode())}
                    for t, v in alts
                ],  # fmt: skip
            }
        )
    return {"content": content, "refusal": None}


def _completion_logprobs(
    token_ids: list[int], lps: list[dict[int, float]], top: int, decode: Any
) -> dict[str, Any]:
    tokens = [decode(t) for t in token_ids]
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [float(d.get(t, float("nan"))) for t, d in zip(token_ids, lps)],
        "top_logprobs": [
            {decode(t): float(v) for t, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]} for d in lps
        ],
        "text_offset": offsets,
    }


def response_line(
    request: dict[str, Any], samples: list[dict[str, Any]], model: str, created: int, decode: Any = None
) -> dict[str, Any]:
    """The output line of one request (a row of :data:`REQUEST_SCHEMA`) from its output rows (one per sample,
    in sample order: ``status``, ``error``, ``generated_text``, ``token_ids``, ``finish_reason``,
    ``num_prompt_tokens``, ``num_generated_tokens``, ``logprobs``)."""
    cid, line = request.get("custom_id"), request["line"]
    out: dict[str, Any] = {"id": _ident("batch_req_", cid, line), "custom_id": cid}
    error = request.get("request_error")
    if error is None:
        failed = [s for s in samples if s.get("status") != "ok"]
        if failed:
            error = failed[0].get("error") or "generation failed"
    if error is not None:
        code = "invalid_request" if request.get("request_error") else "generation_failed"
        if "max_model_len" in error:
            code = "context_length_exceeded"
        elif re.search(
            r"(^|: )image \d+: |\bimage placeholder|^(.*: )?\d+ images but the model takes", error
        ):
            # a bad, missing or extra image, or more than engine.limit_mm_per_prompt (after the column's name)
            code = "invalid_image"
        out.update(response=None, error={"code": code, "message": error, "line": line})
        return out
    if request["endpoint"] == EMBEDDINGS_URL:
        body = _embedding_response(request, samples[0], model)
        out["response"] = {"status_code": 200, "request_id": _ident("req_", cid, line), "body": body}
        out["error"] = None
        return out
    chat = request["endpoint"] == CHAT_URL
    top = request.get("top_logprobs")
    choices = []
    for k, s in enumerate(samples):
        lp = None
        if top is not None and s.get("logprobs") is not None and decode is not None:
            lps = [dict(m) for m in s["logprobs"]]
            fn = _chat_logprobs if chat else _completion_logprobs
            lp = fn(list(s["token_ids"] or []), lps, top, decode)
        fr = _FINISH.get(s.get("finish_reason") or "stop", "stop")
        if chat:
            msg = {"role": "assistant", "content": s["generated_text"], "refusal": None}
            choices.append({"index": k, "message": msg, "finish_reason": fr, "logprobs": lp})
        else:
            choices.append({"index": k, "text": s["generated_text"], "finish_reason": fr, "logprobs": lp})
    prompt_tokens = int(samples[0].get("num_prompt_tokens") or 0) if samples else 0
    completion_tokens = sum(int(s.get("num_generated_tokens") or 0) for s in samples)
    body = {
        "id": _ident("chatcmpl-" if chat else "cmpl-", cid, line),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(created),
        "model": request.get("model") or model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "system_fingerprint": None,
    }
    out["response"] = {"status_code": 200, "request_id": _ident("req_", cid, line), "body": body}
    out["error"] = None
    return out


def _embedding_response(request: dict[str, Any], row: dict[str, Any], model: str) -> dict[str, Any]:
    """OpenAI's embeddings response body for one input (``row``: the job's output row)."""
    vector: Any = [float(v) for v in row["embedding"]]
    if request.get("encoding_format") == "base64":  # little-endian float32, as OpenAI encodes it
        vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    tokens = int(row.get("num_prompt_tokens") or 0)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": vector}],
        "model": request.get("model") or model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
