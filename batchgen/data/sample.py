"""Build the sample prompts shipped with batchgen (``batchgen/sample_data/prompts.parquet``).

    python -m batchgen.data.sample [OUT]     # default: the package's sample_data/prompts.parquet

Questions and openings about Python, which the embedded model (trained on CPython's own documentation, see
``batchgen.models.tiny_training``) can continue plausibly. Shaped like a real batch job: a few-shot template
shared by many rows (the prefix cache serves it once), concept questions, and standalone openings, shuffled so
that rows sharing a prefix are *not* adjacent (prefix grouping has work to do). Columns:

- ``id`` (string), ``task`` (string): a stable id and the template family;
- ``prompt`` (string): the plain-text prompt;
- ``messages`` (list<struct<role, content>>): the same request as chat messages (a shared system prompt
  per family), for ``data.messages_column=messages``;
- ``sampling`` (struct<max_tokens: int32, temperature: double>): per-row overrides picked up by the default
  ``data.sampling_column`` (a lower temperature, which reads better from a small model; short answers for the
  few-shot rows).

Deterministic: same code → same rows in the same order (no clock, no unseeded randomness).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

FEW_SHOT_HEAD = (
    "Q: What does len() do?\nA: Return the number of items in a container.\n\n"
    "Q: What does abs() do?\nA: Return the absolute value of the argument.\n\n"
    "Q: What does sorted() do?\nA: Return a new list containing all items from the iterable in ascending order.\n\n"
)

CALLABLES = [
    "shutil.copyfile()", "logging.getLogger()", "json.dumps()", "json.loads()", "functools.partial()",
    "subprocess.run()", "os.path.join()", "os.listdir()", "os.makedirs()", "re.compile()", "re.sub()",
    "itertools.chain()", "itertools.groupby()", "collections.Counter()", "collections.defaultdict()",
    "math.sqrt()", "random.choice()", "time.sleep()", "pathlib.Path.read_text()", "sys.exit()", "glob.glob()",
    "tempfile.mkdtemp()", "shlex.split()", "textwrap.dedent()", "csv.reader()", "hashlib.sha256()",
    "base64.b64encode()", "gzip.open()", "zipfile.ZipFile()", "heapq.heappush()", "bisect.bisect_left()",
    "copy.deepcopy()", "pickle.dumps()", "struct.pack()", "threading.Lock()", "queue.Queue()",
    "socket.socket()", "urllib.parse.urlparse()", "uuid.uuid4()", "inspect.signature()",
    "operator.itemgetter()", "contextlib.suppress()", "dataclasses.asdict()", "statistics.mean()",
    "decimal.Decimal()", "fractions.Fraction()", "string.Template()", "difflib.unified_diff()",
    "argparse.ArgumentParser()", "traceback.format_exc()", "warnings.warn()", "weakref.ref()",
    "array.array()", "calendar.monthrange()", "fnmatch.fnmatch()", "io.StringIO()", "os.environ.get()",
    "functools.lru_cache()", "itertools.product()", "enum.auto()",
]  # fmt: skip

CONCEPTS = [
    "a generator", "a decorator", "the global interpreter lock", "a context manager", "a coroutine",
    "a module", "a package", "a virtual environment", "the logging module", "the collections module",
    "the threading module", "an iterator", "a list comprehension", "a lambda expression", "a dictionary",
    "a frozen set", "a keyword argument", "the asyncio event loop", "a metaclass", "a descriptor",
]  # fmt: skip

OPENINGS = [
    'The "try" statement specifies', "Exceptions are raised when", "An iterator is an object",
    "A class definition", 'The "return" statement', 'The "with" statement is used to', "A module is",
    'The "import" statement', "Keyword arguments are", "A lambda expression", 'The "yield" statement',
    "Comparison operators", "A list comprehension", 'The "global" statement', "Slicing a sequence",
    "Name binding", 'The "async def" statement', "Format strings", "Integer division", "A dictionary maps",
]  # fmt: skip

TEMPERATURE = 0.7  # reads better than 1.0 from a 2M-parameter model

SYSTEM = {
    "qa": "You answer questions about the Python standard library in one sentence.",
    "concept": "You explain Python concepts briefly.",
    "open": "You write Python documentation.",
}


def sample_rows() -> list[dict]:
    """The sample rows, shuffled deterministically."""
    rows: list[dict] = []

    def add(task: str, prompt: str, user: str, max_tokens: int | None = None) -> None:
        sampling = {"max_tokens": max_tokens, "temperature": TEMPERATURE}
        rows.append(
            {
                "task": task,
                "prompt": prompt,
                "messages": [
                    {"role": "system", "content": SYSTEM[task]},
                    {"role": "user", "content": user},
                ],
                "sampling": sampling,
            }
        )

    for name in CALLABLES:
        q = f"Q: What does {name} do?\nA:"
        add("qa", f"{FEW_SHOT_HEAD}{q}", q, 24)
    for c in CONCEPTS:
        q = f"Q: What is {c}?\nA:"
        add("concept", q, q)
    for o in OPENINGS:
        add("open", o, o)
    random.Random(20240601).shuffle(rows)
    for i, r in enumerate(rows):
        r["id"] = f"sample-{i:04d}"
    return rows


def write_sample(path: str | Path) -> Path:
    """Write the sample Parquet file (two row groups) to `path`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = sample_rows()
    msg = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("task", pa.string()),
            ("prompt", pa.string()),
            ("messages", pa.list_(msg)),
            ("sampling", pa.struct([("max_tokens", pa.int32()), ("temperature", pa.float64())])),
        ]
    )
    table = pa.Table.from_pylist(rows, schema=schema)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=64, compression="zstd")
    return path


def default_path() -> Path:
    return Path(__file__).resolve().parent.parent / "sample_data" / "prompts.parquet"


if __name__ == "__main__":
    out = write_sample(sys.argv[1] if len(sys.argv) > 1 else default_path())
    print(f"wrote {out}")
