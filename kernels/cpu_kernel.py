"""The CPU's C kernels, compiled on first use into one library and loaded with ctypes: paged attention
(``csrc/paged_attention_cpu.c``: decode, prefill, the cascade's prefix half; called by
:func:`.torch_backend.paged_decode_attention` instead of its gather + SDPA, and by its prefill path), the
float32 linear layer (``csrc/linear_cpu.c``, through :mod:`.cpu_linear`), the weight-only quantized one
(``csrc/quant_linear_cpu.c``, through :mod:`.cpu_quant_linear`), the integer-activation one
(``csrc/int8_linear_cpu.c``, through :mod:`.cpu_int8_linear`) and a decoder layer's elementwise
steps (``csrc/layer_ops_cpu.c``, through :mod:`.cpu_ops`).

The decode kernel reads K/V blocks where they lie in the paged cache (no gather into a workspace), handles the query
heads of one KV head together (each K/V row is read once), and runs over (sequence, KV head) items with
OpenMP. Semantics: :mod:`.reference` (scale, sliding window, soft-capping, sinks); results are deterministic
(bit-identical run to run, whatever the thread count).

Build: plain C, no torch headers (< 1 s), with the C compiler of ``$CC``, else Python's configured ``CC``, else
``cc``/``gcc`` on ``PATH``, flags :data:`FLAGS`, into ``<batchgen cache>/cpu_kernels/<key>/`` (the cache root
of :mod:`batchgen.runtime.disk_cache`, ``$BATCHGEN_CACHE``; built atomically by :func:`batchgen.runtime.atomic.build_dir_once`).
The key hashes the source, the compiler (its binary's path, size and mtime), the flags, the machine and the CPU's flags, so a home
directory shared by different cluster nodes never loads a binary built for another CPU. The ``.so`` links
``libgomp.so.1``, the soname torch's wheel bundles: loaded after torch, it shares torch's OpenMP runtime.

A narrow cache (``engine.kv_cache_dtype``: bfloat16, float16, fp8) is read in place and widened to float32 as it
is read (``KV_KINDS``); the step's own K/V are then stored rounded before the kernel attends.

Invariants: :func:`decode` returns None — and the caller takes the torch path — whenever the kernel cannot
serve the call (``BATCHGEN_CPU_KERNEL=0``, no compiler, a failed build or load, a non-CPU tensor, queries
other than float32, a cache dtype outside ``KV_KINDS``, a cache whose last three dims are not contiguous, more than 256 query heads per KV head);
the first such failure of the build is logged once at INFO, never raised. :func:`start_build` compiles in a
background thread (the engine calls it when it is built), so the first decode step rarely waits for it.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .kv_cache_dtype import store_rows
from .options import AttentionOptions
from .paged_kv import PagedKV

logger = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).parent / "csrc" / name
    for name in (
        "paged_attention_cpu.c",
        "linear_cpu.c",
        "layer_ops_cpu.c",
        "quant_linear_cpu.c",
        "quant_digits_cpu.c",
        "int8_linear_cpu.c",
    )
)
HEADERS = tuple(Path(__file__).parent / "csrc" / name for name in ("half.h", "amx.h"))
"""Headers the sources include (part of the build key)."""
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LIB_NAME = "batchgen_cpu.so"
MAX_HEADS = 256  # query heads one work item of the kernel may hold (so: per KV head at most)
ENV_SWITCH = "BATCHGEN_CPU_KERNEL"
CASCADE_MIN_SAVED = 0.3
"""With the kernel, the torch backend's cascade decode (the suffixes read in place by :func:`decode_suffix`,
each group's shared prefix once by :func:`merge_prefix`) goes first when it saves at least this share of the
block reads ..."""
CASCADE_MIN_GROUP_BLOCKS = 16
"""... counting only groups that save at least this many block reads each. Measured with `python -m
batchgen.bench.kernels --cpu-cascade` (the bench model's heads, 2 threads): the cascade is 1.7-3.0x faster
than the kernel alone where groups save 68-91% of the reads, and 4-44% slower where they save 8-25% (groups
of 4-8 sharing 2-4 blocks: the second call's fixed cost outweighs the reads saved)."""

_lock = threading.Lock()
_thread: threading.Thread | None = None
_state: dict[str, object] = {}  # "lib": the loaded CDLL or None once the build was tried


def enabled() -> bool:
    """False when ``BATCHGEN_CPU_KERNEL=0`` (read on every call, so it can be switched at run time)."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def available() -> bool:
    """Whether the C kernels can run here (the library enabled, built and loaded; waits for a build)."""
    return enabled() and library() is not None


def compiler() -> list[str] | None:
    """The C compiler command: ``$CC``, else Python's configured ``CC`` if on ``PATH``, else ``cc``/``gcc``."""
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC")):
        if candidate:
            cmd = shlex.split(candidate)
            if cmd and shutil.which(cmd[0]):
                return cmd
    for name in ("cc", "gcc"):
        if shutil.which(name):
            return [name]
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler_identity(cc: list[str]) -> str:
    """The compiler binary's resolved path, size and modification time: changes when it is replaced or
    upgraded, and costs a ``stat`` instead of running ``cc --version`` at every start-up."""
    path = os.path.realpath(shutil.which(cc[0]) or cc[0])
    try:
        st = os.stat(path)
    except OSError:
        return path
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def build_key(cc: list[str], defines: tuple[str, ...] = ()) -> str:
    """SHA-256 (hex, 16 chars) of everything the binary depends on."""
    flags = [*FLAGS, *(f"-D{d}" for d in defines)]
    sources = [src.read_bytes().hex() for src in (*SOURCES, *HEADERS)]
    parts = [*sources, _compiler_identity(cc), " ".join(cc), *flags, platform.machine()]
    return hashlib.sha256("\0".join([*parts, _cpu_flags()]).encode()).hexdigest()[:16]


def build(cc: list[str], defines: tuple[str, ...] = ()) -> Path:
    """Compile the kernels (or find them built) and return the ``.so`` path; raises on failure. ``defines``:
    preprocessor macros (``BATCHGEN_GENERIC``: the plain-C loops instead of the AVX2 ones; tests build both)."""
    from batchgen.runtime.atomic import build_dir_once
    from batchgen.runtime.disk_cache import cache_root

    def compile_into(tmp: Path) -> None:
        # each source compiled on its own, all at once (the two large ones take about as long each), then linked
        flags = [*FLAGS, *(f"-D{d}" for d in defines)]
        objects = [tmp / f"{src.stem}.o" for src in SOURCES]
        cmds = [[*cc, *flags, "-c", "-o", str(obj), str(src)] for src, obj in zip(SOURCES, objects)]
        procs = [
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for cmd in cmds
        ]
        try:
            for cmd, proc in zip(cmds, procs):
                _, err = proc.communicate(timeout=300)
                if proc.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed: {err.strip()[-2000:]}")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        cmd = [*cc, *flags, "-o", str(tmp / LIB_NAME), *map(str, objects), "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()[-2000:]}")
        for obj in objects:
            obj.unlink(missing_ok=True)

    target = cache_root() / "cpu_kernels" / build_key(cc, defines)
    return Path(build_dir_once(target, LIB_NAME, compile_into)) / LIB_NAME


def _load(defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        logger.info("no C compiler found: CPU attention and linear layers use the torch path")
        return None
    try:
        lib = ctypes.CDLL(str(build(cc, defines)))
        fn = lib.batchgen_paged_decode_f32
    except Exception as exc:  # a failed compile, load or symbol lookup: the torch path serves
        logger.info("CPU C kernels unavailable (%s): using the torch path", exc)
        return None
    i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    fn.argtypes = (
        [ptr, i64, i64, ptr, ptr, i64, ptr, i64, ptr, ptr]
        + [i32] * 5
        + [f32, i32, f32, ptr, i32, i32, i64, i64, ptr, ptr]
        + [ptr, i64, i64, ptr, i64, i64, ptr, i32]
    )
    fn.restype = i32
    prefix = lib.batchgen_cascade_prefix_f32
    prefix.argtypes = (
        [ptr, i64, i64, ptr, ptr, i64, i64, i32, ptr, ptr, ptr, i64, ptr, ptr, ptr]
        + [i32] * 5
        + [f32, i32, i32, i32]
    )
    prefix.restype = i32
    prefill_fn = lib.batchgen_paged_prefill_f32
    prefill_fn.argtypes = (
        [ptr, i64, i64, ptr, ptr, i64, i64, ptr, i64, i64, ptr, ptr]
        + [i32] * 5
        + [f32, i32, i32, ptr, ptr, i32, i32]
    )
    prefill_fn.restype = i32
    for name in ("f32", "bf16w", "f16w"):
        linear = getattr(lib, f"batchgen_linear_{name}")
        linear.argtypes = [ptr, i64, ptr, ptr, ptr, i64] + [i32] * 4
        linear.restype = i32
    lib.batchgen_rms_norm_f32.argtypes = [
        ptr,
        i64,
        i64,
        ptr,
        i64,
        ptr,
        i32,
        ptr,
        i32,
        i32,
        i32,
        f32,
        i32,
        i32,
    ]
    lib.batchgen_quant_linear.argtypes = [ptr, i64, ptr, i64, i32, ptr, ptr, i64] + [i32] * 4
    lib.batchgen_quant_dequantize.argtypes = [ptr, i64, i32, ptr, i32, i32]
    lib.batchgen_quant_linear.restype = lib.batchgen_quant_dequantize.restype = i32
    lib.batchgen_quant_integer_inputs.argtypes = []
    lib.batchgen_quant_integer_inputs.restype = i32
    lib.batchgen_int_linear.argtypes = [ptr, i64, ptr, i32, ptr, i32, i32, ptr, ptr, i64] + [i32] * 4
    lib.batchgen_int_linear.restype = i32
    lib.batchgen_fp8_linear.argtypes = [ptr, i64, ptr, ptr, i32, ptr, ptr, i64] + [i32] * 4
    lib.batchgen_fp8_linear.restype = i32
    lib.batchgen_quantize_rows_s8.argtypes = [ptr, i64, i32, i32, ptr, i32, i32, ptr, ptr, ptr, i32]
    lib.batchgen_int8_linear.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, i32, ptr, ptr, i64] + [i32] * 4
    lib.batchgen_quantize_rows_s8.restype = lib.batchgen_int8_linear.restype = i32
    lib.batchgen_silu_mul_f32.argtypes = [ptr, i64, ptr, i32, i32, i32]
    lib.batchgen_rope_f32.argtypes = [ptr, i64, ptr, ptr, ptr] + [i32] * 5
    lib.batchgen_store_kv_f32.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, i64, i32, i32, i32]
    for name in ("rms_norm", "silu_mul", "rope", "store_kv"):
        getattr(lib, f"batchgen_{name}_f32").restype = i32
    return lib


def _build_in_thread() -> None:
    lib = _load()
    with _lock:
        _state["lib"] = lib


def start_build() -> None:
    """Start compiling/loading the kernel in a background thread (idempotent; no-op when disabled)."""
    global _thread
    if not enabled() or sys.platform == "win32":
        return
    with _lock:
        if _thread is None and "lib" not in _state:
            # Python's sysconfig fills its variables on first use without a lock: the build thread reading the
            # compiler from it while the main thread's imports first read it can leave one of them a half-filled
            # table (AttributeError: 'userbase'); filled here, before the thread starts
            sysconfig.get_config_vars()
            _thread = threading.Thread(target=_build_in_thread, name="batchgen-cpu-kernel", daemon=True)
            _thread.start()


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it now (or waiting for :func:`start_build`) on first call."""
    if "lib" in _state:
        return _state["lib"]  # type: ignore[return-value]
    if not enabled() or sys.platform == "win32":
        return None
    start_build()
    thread = _thread
    if thread is not None:
        thread.join()
    with _lock:
        if "lib" not in _state:  # a forked child: the parent's build thread does not run here
            _state["lib"] = _load()
    return _state["lib"]  # type: ignore[return-value]


def _after_fork_in_child() -> None:
    global _lock, _thread
    _lock, _thread = threading.Lock(), None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def reset() -> None:
    """Forget the loaded library (tests: rebuild under another environment)."""
    global _thread
    with _lock:
        if _thread is not None:
            _thread.join()
        _thread = None
        _state.clear()


def serves(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether :func:`decode` will run the kernel for these tensors (enabled, supported, library loaded:
    waits for a build under way)."""
    return enabled() and supports(q, k_cache, v_cache) and library() is not None


KV_KINDS = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
}
"""Cache dtypes the kernels read (``kv_kind`` in the C source: narrow ones are widened as they are read)."""


def supports(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether the kernel can serve these tensors (CPU, float32 queries, a float32 or narrow cache of
    :data:`KV_KINDS`, caches contiguous within a block)."""
    if q.device.type != "cpu" or k_cache.device.type != "cpu":
        return False
    if q.dtype != torch.float32 or k_cache.dtype != v_cache.dtype or k_cache.dtype not in KV_KINDS:
        return False
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        return False
    inner = (num_kv_heads * head_dim, head_dim, 1)
    if k_cache.stride()[1:] != inner or q.stride(-1) != 1:
        return False
    return q.shape[1] % num_kv_heads == 0 and q.shape[1] // num_kv_heads <= MAX_HEADS


def heads_per_item(batch: int, num_kv_heads: int, group: int, threads: int) -> int:
    """KV heads per work item: the most (each token's K/V rows of an item are one contiguous span, read as a
    stream) that still leave >= 4 items per thread, or 1 when the batch is too small for that."""
    for n in range(num_kv_heads, 0, -1):
        if num_kv_heads % n == 0 and n * group <= MAX_HEADS and batch * (num_kv_heads // n) >= 4 * threads:
            return n
    return 1


@dataclass
class NewKV:
    """A decode step's own K/V rows, ``key``/``value`` ``[B, Hkv, D]`` float32 (last dim contiguous), not yet in
    the cache: :func:`decode` and :func:`decode_suffix` write them at ``slots`` ``[B]`` int64 (−1: none) as they
    attend, and set ``written``; a caller whose kernel call did not run stores them itself first."""

    key: Tensor
    value: Tensor
    slots: Tensor
    written: bool = False


def decode(q: Tensor, kv: PagedKV, options: AttentionOptions, new_kv: NewKV | None = None) -> Tensor | None:
    """Paged decode attention ``q [B,Hq,D]`` → ``[B,Hq,D]`` by the C kernel, or None when it cannot serve it
    (then the caller's torch path does). Every ``kv.seq_lens[b]`` must be >= 1 (as everywhere in this package).
    ``new_kv``: the step's K/V, stored by the same pass (see :class:`NewKV`)."""
    res = _call(q, kv, options, None, new_kv)
    return None if res is None else res[0]


def decode_suffix(
    q: Tensor, kv: PagedKV, scale: float, starts: Tensor, new_kv: NewKV | None = None
) -> tuple[Tensor, Tensor] | None:
    """The suffix half of cascade attention: sequence ``b`` attends only to its keys at positions >=
    ``starts[b]``; returns ``(out [B,Hq,D], lse [B,Hq])`` (natural log-sum-exp of the scaled logits, -inf with
    a zero output where a sequence has no such key), or None when the kernel cannot serve the call."""
    return _call(q, kv, AttentionOptions(scale), starts, new_kv)


def _new_kv_args(new_kv: NewKV | None) -> list[object]:
    """The kernel's trailing arguments for ``new_kv`` (NULLs when there is nothing to store)."""
    if new_kv is None or new_kv.written:
        return [None, 0, 0, None, 0, 0, None]
    k, v, slots = new_kv.key, new_kv.value, new_kv.slots
    return [k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), slots.data_ptr()]


def _storable(new_kv: NewKV | None, batch: int, num_kv_heads: int, head_dim: int) -> bool:
    if new_kv is None or new_kv.written:
        return True
    k, v, slots = new_kv.key, new_kv.value, new_kv.slots
    return (
        k.dtype == v.dtype == torch.float32
        and k.shape == v.shape == (batch, num_kv_heads, head_dim)
        and k.stride(-1) == v.stride(-1) == 1
        and slots.dtype == torch.int64
        and slots.is_contiguous()
        and slots.shape == (batch,)
    )


def _library_for(q: Tensor, kv: PagedKV) -> ctypes.CDLL | None:
    """The loaded library when the kernels can serve ``q`` over ``kv`` (enabled, supported tensors), else None."""
    if not enabled() or not supports(q, kv.k_cache, kv.v_cache):
        return None
    return library()


def _call(
    q: Tensor, kv: PagedKV, options: AttentionOptions, starts: Tensor | None, new_kv: NewKV | None = None
) -> tuple[Tensor, Tensor | None] | None:
    k_cache, v_cache, block_tables, seq_lens = kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens
    lib = _library_for(q, kv)
    if lib is None:
        return None
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if not _storable(new_kv, batch, num_kv_heads, head_dim):
        return None
    kind = KV_KINDS[k_cache.dtype]
    if kind and new_kv is not None and not new_kv.written:  # a narrow cache: rounded rows stored first
        store_rows(new_kv.key, new_kv.value, k_cache, v_cache, new_kv.slots)
        new_kv.written = True
    tables = _int32(block_tables)
    lens = _int32(seq_lens)
    sinks = options.sinks
    if sinks is not None:
        sinks = sinks.detach().to(device="cpu", dtype=torch.float32).contiguous()
    out = torch.empty(batch, num_q_heads, head_dim, dtype=torch.float32)
    lse = torch.empty(batch, num_q_heads, dtype=torch.float32) if starts is not None else None
    starts = _int32(starts) if starts is not None else None
    threads = torch.get_num_threads()
    status = lib.batchgen_paged_decode_f32(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
        tables.data_ptr(), tables.stride(0), lens.data_ptr(), out.data_ptr(), batch, num_q_heads,
        num_kv_heads, head_dim, k_cache.shape[1], options.scale, min(options.sliding_window or 0, 2**31 - 1),
        options.softcap or 0.0, None if sinks is None else sinks.data_ptr(), threads,
        heads_per_item(batch, num_kv_heads, num_q_heads // num_kv_heads, threads), tables.shape[1],
        k_cache.shape[0], None if starts is None else starts.data_ptr(), None if lse is None else lse.data_ptr(),
        *_new_kv_args(new_kv), kind,
    )  # fmt: skip
    if status != 0:
        return None
    if new_kv is not None:
        new_kv.written = True
    return out, lse


@dataclass
class PrefixGroups:
    """Sequences grouped by a shared prefix of whole blocks, as :func:`merge_prefix` takes them (int32, CPU):
    group ``g``'s sequences are ``seqs[offsets[g]:offsets[g + 1]]``, its prefix the first ``num_blocks[g]``
    block ids of ``tables[g]``."""

    offsets: Tensor
    seqs: Tensor
    tables: Tensor
    num_blocks: Tensor

    @classmethod
    def build(cls, groups: list[tuple[Tensor, Tensor]]) -> PrefixGroups:
        """From ``(sequence indices, prefix block ids)`` pairs."""
        sizes = [int(idx.numel()) for idx, _ in groups]
        widths = [int(ids.numel()) for _, ids in groups]
        tables = np.zeros((len(groups), max(widths, default=0)), dtype=np.int32)
        for g, (_, ids) in enumerate(groups):
            tables[g, : widths[g]] = ids.cpu().numpy()
        offsets = np.array([0, *itertools.accumulate(sizes)], dtype=np.int32)
        seqs = np.concatenate([idx.cpu().numpy() for idx, _ in groups]) if groups else offsets[:0]
        as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
        return cls(as_tensor(offsets), as_tensor(seqs), as_tensor(tables), as_tensor(widths))


PREFIX_CHUNK = 16
"""Sequences of a group whose query rows one work item of :func:`merge_prefix` takes (the prefix is read once
per chunk, so larger groups are split for the threads)."""


def merge_prefix(
    q: Tensor, kv: PagedKV, scale: float, groups: PrefixGroups, out: Tensor, lse: Tensor
) -> bool:
    """The shared-prefix half of cascade decode, merged in place into the suffix half: for every sequence of
    ``groups``, ``out [B,Hq,D]`` / ``lse [B,Hq]`` (float32, contiguous; the results of :func:`decode_suffix`)
    become the attention over the group's prefix and the sequence's own keys together. Each prefix is read once
    per group (per :data:`PREFIX_CHUNK` sequences). False when the kernel cannot serve the call (``out`` and
    ``lse`` are then unchanged only if it was refused before running; callers recompute on False)."""
    lib = _library_for(q, kv)
    if lib is None or not (out.is_contiguous() and lse.is_contiguous()):
        return False
    k_cache, v_cache = kv.k_cache, kv.v_cache
    batch, num_q_heads, head_dim = q.shape
    status = lib.batchgen_cascade_prefix_f32(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
        k_cache.shape[0], groups.offsets.numel() - 1, groups.offsets.data_ptr(), groups.seqs.data_ptr(),
        groups.tables.data_ptr(), groups.tables.stride(0), groups.num_blocks.data_ptr(), out.data_ptr(),
        lse.data_ptr(), batch, num_q_heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale, PREFIX_CHUNK,
        torch.get_num_threads(), KV_KINDS[k_cache.dtype],
    )  # fmt: skip
    return status == 0


PREFILL_CHUNK = 32
"""Query tokens one work item of :func:`prefill` takes (its keys are read once for all of them)."""


def prefill(
    q: Tensor, cu_seqlens_q: Tensor, kv: PagedKV, scale: float, *, causal: bool = True, with_lse: bool = False
) -> tuple[Tensor, Tensor | None] | None:
    """Paged prefill attention by the C kernel: sequence ``b``'s queries ``q[cu[b]:cu[b+1]]`` (``q [T,Hq,D]``)
    at positions ``seq_lens[b] - q_len_b ..`` attend to keys ``0..p`` (``causal``) or to all its keys, read in
    place from the paged cache. Returns ``(out [T,Hq,D], lse [T,Hq] or None)`` (float32; ``lse``: each query's
    natural log-sum-exp, with ``with_lse``), or None when the kernel cannot serve the call."""
    lib = _library_for(q, kv)
    if lib is None:
        return None
    k_cache, v_cache = kv.k_cache, kv.v_cache
    total, num_q_heads, head_dim = q.shape
    tables, lens, cu = _int32(kv.block_tables), _int32(kv.seq_lens), _int32(cu_seqlens_q)
    out = torch.empty(total, num_q_heads, head_dim, dtype=torch.float32)
    lse = torch.empty(total, num_q_heads, dtype=torch.float32) if with_lse else None
    status = lib.batchgen_paged_prefill_f32(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
        k_cache.shape[0], tables.data_ptr(), tables.stride(0), tables.shape[1], lens.data_ptr(), cu.data_ptr(),
        lens.numel(), num_q_heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale, int(causal),
        PREFILL_CHUNK, out.data_ptr(), None if lse is None else lse.data_ptr(), torch.get_num_threads(),
        KV_KINDS[k_cache.dtype],
    )  # fmt: skip
    return (out, lse) if status == 0 else None


def _int32(t: Tensor) -> Tensor:
    return (t if t.dtype == torch.int32 else t.to(torch.int32)).contiguous()
