"""Shared fixtures: tiny random-weight Hugging Face checkpoints built offline, once per session.

- `llama_ckpt`, `mistral_ckpt`, `qwen2_ckpt`, `qwen3_ckpt`: paths (str) of default tiny checkpoints
  (hidden 64, 2 layers, 4 query heads, 2 kv heads, vocab 4096, float32, untied; Qwen2 has QKV bias,
  Qwen3 QK-norm; seeds 0..3 in that order). Built with `batchgen.models.tiny.build_checkpoint`.
- `ckpt_factory(arch="llama", **kwargs) -> str`: any other variant (same keywords as
  `build_checkpoint`); identical arguments return the same directory (memoised for the session).
- `tiny_ckpt`: the embedded default model (`tiny_default_checkpoint`) built in the session tmp dir.
- `BATCHGEN_CACHE` points at a session tmp dir so tests never touch ~/.cache/batchgen. Under pytest-xdist the
  controller compiles the CPU C kernels once for all workers; `link_shared_kernels(cache)` shows that build in
  another fresh cache (a subprocess with its own `BATCHGEN_CACHE`).

Plain helpers shared by the job tests (import them: ``from conftest import job_config``):
`job_config` (a small CPU JobConfig), `part_contents` (what must be identical after a resume),
`windows_done` (a manifest's finished windows), `env_without_slurm` (a subprocess environment whose shard
defaults are not taken from a surrounding Slurm array), `random_seed` (fixed unless asked otherwise),
`batchgen_cli` (the ``batchgen`` command run as a subprocess), `cli_job` (the configuration that command
composes, to run the same job in process), `read_parts` (an output's parts as one table), `write_invalid_utf8` (a string array holding bytes that are
not UTF-8), `try_mount_tmpfs` (a small tmpfs, or None where mounting is not allowed), `EngineAtStep` / `signal_after` (an engine that
runs an action, e.g. sends a signal, just before a given step).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.engine.config import EngineConfig
from batchgen.job.config import (
    DataOptions,
    JobConfig,
    ModelOptions,
    RunOptions,
    ShardOptions,
    default_sampling,
)
from batchgen.models.tiny import build_checkpoint, tiny_default_checkpoint

SHARED_KERNELS_ENV = "BATCHGEN_TEST_SHARED_KERNELS"
"""Set by the controller of a pytest-xdist run: a directory whose ``cpu_kernels/`` every worker's cache links to."""
_prebuild_key = pytest.StashKey[tuple]()  # the controller's build process and directory

_PREBUILD = """
import threading
from batchgen.kernels import cpu_kernel as k
cc = k.compiler()
builds = [threading.Thread(target=k.build, args=(cc, d)) for d in ((), ("BATCHGEN_GENERIC",))] if cc else []
for t in builds:
    t.start()
for t in builds:
    t.join()
"""


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker computes on one thread: the workers share the cores instead of each
    starting torch's full pool on all of them (OpenMP threads that wait on each other's cores). Engines still
    take their count from batchgen.runtime.threads, capped by this one.

    The controller of an xdist run compiles the CPU C kernels (the machine's build and the plain-C one)
    once, in the background while the workers collect, into a directory every worker's cache links to
    (:func:`_isolated_batchgen_cache`): each worker would otherwise compile both itself. It also sets
    ``OMP_WAIT_POLICY=PASSIVE`` (unless set) for the workers and the processes they start."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
    elif getattr(config.option, "dist", "no") != "no" and not os.environ.get(SHARED_KERNELS_ENV):
        import sys
        import tempfile
        import threading

        shared = Path(tempfile.mkdtemp(prefix="batchgen-test-kernels-"))
        (shared / "cpu_kernels").mkdir()
        lock = open(shared / ".building", "w")  # noqa: SIM115 (held until the build ends)
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.Popen(
            [sys.executable, "-c", _PREBUILD],
            env={**os.environ, "BATCHGEN_CACHE": str(shared)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def release() -> None:
            proc.wait()
            fcntl.flock(lock, fcntl.LOCK_UN)

        threading.Thread(target=release, name="kernel-prebuild", daemon=True).start()
        os.environ[SHARED_KERNELS_ENV] = str(shared)
        config.stash[_prebuild_key] = (proc, shared)
        # Two workers keep both cores busy: OpenMP's waiters sleep (what batchgen decides on busy cores), set
        # for the workers and every process they start, so none spends a look at the load to decide it.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_unconfigure(config: pytest.Config) -> None:
    if (prebuild := config.stash.get(_prebuild_key, None)) is not None:
        import shutil

        proc, shared = prebuild
        proc.kill()
        proc.wait()
        os.environ.pop(SHARED_KERNELS_ENV, None)
        shutil.rmtree(shared, ignore_errors=True)


def link_shared_kernels(cache: Path) -> None:
    """Make the compiled CPU kernels of this xdist run visible in the batchgen cache ``cache`` (a no-op
    outside xdist): ``cache/cpu_kernels`` links to the controller's build directory."""
    shared = os.environ.get(SHARED_KERNELS_ENV)
    if shared and not (cache / "cpu_kernels").exists():
        cache.mkdir(parents=True, exist_ok=True)
        (cache / "cpu_kernels").symlink_to(Path(shared) / "cpu_kernels", target_is_directory=True)


def _wait_for_shared_kernels(build: Callable[..., Path]) -> Callable[..., Path]:
    """``cpu_kernel.build``, first waiting (once) until the controller's build of the kernels has ended."""
    waited = []

    def wait_then_build(*args, **kwargs) -> Path:
        if not waited:
            with open(Path(os.environ[SHARED_KERNELS_ENV]) / ".building") as f:
                fcntl.flock(f, fcntl.LOCK_SH)
            waited.append(True)
        return build(*args, **kwargs)

    return wait_then_build


@pytest.fixture(scope="session", autouse=True)
def _isolated_batchgen_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    cache = tmp_path_factory.mktemp("batchgen_cache")
    old = os.environ.get("BATCHGEN_CACHE")
    os.environ["BATCHGEN_CACHE"] = str(cache)
    patch = pytest.MonkeyPatch()
    if os.environ.get(SHARED_KERNELS_ENV):
        from batchgen.kernels import cpu_kernel

        link_shared_kernels(cache)
        patch.setattr(cpu_kernel, "build", _wait_for_shared_kernels(cpu_kernel.build))
    yield cache
    patch.undo()
    if old is None:
        os.environ.pop("BATCHGEN_CACHE", None)
    else:
        os.environ["BATCHGEN_CACHE"] = old


RUN_FIRST = (
    "test_ray.py",
    "test_slurm.py",
    "test_tensor_parallel.py",
    "test_job_faults.py",
    "test_kernels.py",
    "test_install.py",
    "test_vision_replicas.py",
    "test_openai_batch_samples.py",
    "test_storage_s3.py",
    "test_replicas.py",
    "test_pooling_job.py",
    "test_job_resume.py",
    "test_pooling_tp.py",
    "test_commit_kill_local.py",
    "test_exit_statuses.py",
    "test_lora_parallel.py",
)
"""The test files measured slowest, slowest first. A file runs whole on one xdist worker (``--dist loadfile``)
and, with ``--no-loadscope-reorder``, the workers take the files in collection order: starting the longest
ones first keeps one worker from finishing a long file alone at the end. The other files follow, those with
more tests first (xdist's own order)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist: :data:`RUN_FIRST` first, then by tests per file (the order within a file is kept)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from collections import Counter

    first = {name: i for i, name in enumerate(RUN_FIRST)}
    per_file = Counter(item.path for item in items)
    items.sort(key=lambda item: (first.get(item.path.name, len(first)), -per_file[item.path], str(item.path)))


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    root = tmp_path_factory.mktemp("ckpts")
    built: dict[str, str] = {}

    def make(arch: str = "llama", **kwargs) -> str:
        key = json.dumps({"arch": arch, **kwargs}, sort_keys=True, default=str)
        if key not in built:
            built[key] = build_checkpoint(root / f"{arch}-{len(built)}", arch, **kwargs)
        return built[key]

    return make


@pytest.fixture(scope="session")
def llama_ckpt(ckpt_factory: Callable[..., str]) -> str:
    return ckpt_factory("llama")


@pytest.fixture(scope="session")
def mistral_ckpt(ckpt_factory: Callable[..., str]) -> str:
    return ckpt_factory("mistral", seed=1)


@pytest.fixture(scope="session")
def qwen2_ckpt(ckpt_factory: Callable[..., str]) -> str:
    return ckpt_factory("qwen2", seed=2)


@pytest.fixture(scope="session")
def qwen3_ckpt(ckpt_factory: Callable[..., str]) -> str:
    return ckpt_factory("qwen3", seed=3)


@pytest.fixture(scope="session")
def tiny_ckpt() -> str:
    return tiny_default_checkpoint()


# ------------------------------------------------------------------------------------------ job helpers
def job_config(ckpt: str, inp: Path | str, out: Path | str, **over: dict) -> JobConfig:
    """A small CPU job: windows of 8 rows, 256 KV blocks, 8 sequences, 6 tokens at temperature 0.8, no
    progress output. ``data=``, ``engine=`` and ``sampling=`` dicts override single keys
    (``data={"shard": {...}}`` for the shard)."""
    data = {"input": str(inp), "output": str(out), "window_rows": 8, **over.pop("data", {})}
    shard = data.pop("shard", {})
    engine = {"device": "cpu", "num_blocks": 256, "max_num_seqs": 8, **over.pop("engine", {})}
    sampling = {"max_tokens": 6, "temperature": 0.8, **over.pop("sampling", {})}
    assert not over, f"unknown groups {sorted(over)}"
    return JobConfig(
        model=ModelOptions(path=ckpt),
        data=DataOptions(**data, shard=ShardOptions(**shard)),
        engine=EngineConfig(**engine),
        sampling=dataclasses.replace(default_sampling(), **sampling),
        run=RunOptions(progress="off"),
    )


def part_contents(directory: Path) -> dict[str, tuple]:
    """Each part's rows and schema metadata, without num_cached_tokens.

    num_cached_tokens reports what the prefix cache served in *that* run: a resumed window starts with a
    cold cache, so only that column may differ from an uninterrupted run.
    """
    out = {}
    for p in sorted(Path(directory).glob("part-*.parquet")):
        t = pq.read_table(p)
        out[p.name] = (t.drop_columns(["num_cached_tokens"]).to_pylist(), t.schema.metadata)
    return out


def _manifest(directory: Path) -> dict:
    """The state of a shard directory, as ``_manifest.json`` with the commit log applied ({} while it has none or
    is being replaced)."""
    from batchgen.data.manifest import Manifest

    try:
        m = Manifest.load(Path(directory))
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return json.loads(m.to_json()) if m is not None else {}


def windows_done(directory: Path) -> int:
    """Windows listed in the manifest of a shard directory (0 while it has none or is being replaced)."""
    return len(_manifest(directory).get("windows", {}))


def wait_for_rows_done(proc: subprocess.Popen, directory: Path, rows: int, timeout: float = 240) -> int:
    """Poll (every 20 ms) until the manifest of ``directory`` counts at least ``rows`` rows done, ``proc`` has
    exited or ``timeout`` seconds have passed; return the rows done at the last poll."""
    deadline, saved = time.monotonic() + timeout, 0
    while proc.poll() is None and time.monotonic() < deadline:
        saved = _manifest(directory).get("rows_done", 0)
        if saved >= rows:
            break
        time.sleep(0.02)
    return saved


def env_without_slurm(**extra: str) -> dict[str, str]:
    """os.environ without SLURM_ARRAY_TASK_ID/COUNT (they set the shard defaults), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT")}
    env.update(extra)
    return env


def batchgen_cli(args: list[str], cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """The ``batchgen`` command as a user types it (the console script of this environment), run in `cwd`
    without a surrounding Slurm array's shard defaults; stdout and stderr captured as text."""
    import sys

    script = Path(sys.executable).with_name("batchgen")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "batchgen.cli"]
    return subprocess.run(
        [*cmd, *args], cwd=cwd, env=env_without_slurm(**env), capture_output=True, text=True, timeout=timeout
    )


def cli_job(args: list[str]) -> object:
    """The job configuration the ``batchgen`` command composes from `args` (its ``key=value`` overrides), to
    run the same job in process with ``run_job`` (no interpreter start, no imports: a reference output costs
    the generation alone). Relative paths resolve against this process's working directory: pass absolute
    ones. The shard defaults come from no surrounding Slurm array (as :func:`env_without_slurm`)."""
    from hydra import compose, initialize_config_module

    from batchgen.job.hydra_setup import register_configs, register_resolvers

    register_configs()
    register_resolvers()
    saved = {
        k: os.environ.pop(k) for k in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT") if k in os.environ
    }
    try:
        with initialize_config_module(config_module="batchgen.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=args)
        from omegaconf import OmegaConf

        OmegaConf.resolve(cfg)  # the shard defaults read the environment now, without Slurm's
        return cfg
    finally:
        os.environ.update(saved)


def random_seed() -> int:
    """Seed of tests that pick random moments (e.g. when to kill a job): 0 unless $BATCHGEN_TEST_SEED says
    otherwise, an integer or ``random`` (from the clock). Tests put the seed in their failure messages."""
    value = os.environ.get("BATCHGEN_TEST_SEED", "0")
    return time.time_ns() % 10**6 if value == "random" else int(value)


def read_parts(directory: Path) -> pa.Table:
    """The part files of one output directory, concatenated in window order."""
    parts = sorted(Path(directory).glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(p) for p in parts]) if parts else pa.table({})


def write_invalid_utf8(values: list[bytes | None]) -> pa.Array:
    """A pyarrow *string* array whose values are the given bytes, valid UTF-8 or not (as a broken writer
    would produce: Parquet does not check)."""
    buf = pa.array(values, type=pa.binary())
    return pa.Array.from_buffers(pa.string(), len(buf), buf.buffers(), null_count=buf.null_count)


def try_mount_tmpfs(path: Path, size: str, read_only: bool = False) -> bool:
    """Mount a tmpfs of `size` at `path` (created); False where this machine does not allow it."""
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if read_only else "")
    try:
        p = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return p.returncode == 0


def umount(path: Path) -> None:
    import subprocess

    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


class EngineAtStep:
    """Wraps an engine; calls `action()` just before its `at`-th `step()` (counting from 1); otherwise it is
    the engine itself."""

    def __init__(self, engine, at: int, action: Callable[[], object]) -> None:
        self._e, self._at, self._action, self._n = engine, at, action, 0

    def __getattr__(self, name):
        return getattr(self._e, name)

    def step(self):
        self._n += 1
        if self._n == self._at:
            self._action()
        return self._e.step()


def signal_after(engine, at: int, sig: int = signal.SIGINT) -> EngineAtStep:
    """`engine`, sending `sig` to this process at step `at` (the job's real handlers catch it)."""
    return EngineAtStep(engine, at, lambda: os.kill(os.getpid(), sig))


_NOT_SOURCES = (
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".venv*", ".pytest_cache", ".ruff_cache",
    ".hypothesis", "outputs", "multirun", "batchgen_output", ".whl", ".gpu", "tests",
)  # fmt: skip
"""What a source checkout may hold besides the package sources: never copied into the out-of-tree build."""


def _unmet_build_requirements(repo: Path) -> list[str]:
    """pyproject.toml's build-system requirements this interpreter lacks (the build runs without isolation:
    no network)."""
    from importlib.metadata import PackageNotFoundError, version

    import tomllib
    from packaging.requirements import Requirement

    unmet = []
    for spec in tomllib.loads((repo / "pyproject.toml").read_text())["build-system"]["requires"]:
        req = Requirement(spec)
        try:
            if not req.specifier.contains(version(req.name), prereleases=True):
                unmet.append(spec)
        except PackageNotFoundError:
            unmet.append(spec)
    return unmet


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """batchgen's wheel, built once per session from a copy of the checkout (setuptools writes build/ and
    *.egg-info/ beside the sources); building it leaves the source tree as it found it."""
    import shutil
    import sys

    repo = Path(__file__).resolve().parents[1]
    if unmet := _unmet_build_requirements(repo):
        pytest.skip(f"this environment cannot build the wheel offline: it lacks {unmet}")
    before = sorted(p.name for p in repo.iterdir())
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(repo, src, ignore=shutil.ignore_patterns(*_NOT_SOURCES))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(tmp),
        ".",
    ]
    out = subprocess.run(cmd, cwd=src, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in repo.iterdir()) == before, "building the wheel wrote into the source tree"
    (whl,) = tmp.glob("batchgen-*.whl")
    return whl
