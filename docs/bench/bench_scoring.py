"""Scoring with many continuations of shared contexts, prefix cache on vs off (tiny llama, CPU)."""

import random
import time

from batchgen import LLM
from batchgen.models.tiny import build_checkpoint

ck = build_checkpoint("/tmp/scoring_bench_ckpt", "llama", max_position_embeddings=1024)
rng = random.Random(0)
ctxs = [[rng.randrange(5, 4000) for _ in range(400)] for _ in range(8)]
pairs = [(c, [rng.randrange(5, 4000) for _ in range(rng.randint(1, 5))]) for c in ctxs for _ in range(8)]
res = {}
for pc in (True, False):
    llm = LLM(ck, device="cpu", dtype="float32", num_blocks=2048, max_num_seqs=64, enable_prefix_caching=pc)
    llm.score([p[0] for p in pairs[:2]], [p[1] for p in pairs[:2]])  # warm-up (different contexts? same: ok)
    llm.engine.scheduler.kv  # noqa
    before = llm.engine.stats.prompt_tokens_computed
    t0 = time.perf_counter()
    s = llm.score([p[0] for p in pairs], [p[1] for p in pairs])
    dt = time.perf_counter() - t0
    res[pc] = (dt, [x.loglikelihood for x in s])
    print(
        f"prefix_caching={pc}: {len(pairs)} pairs in {dt:.2f}s, prompt tokens computed "
        f"{llm.engine.stats.prompt_tokens_computed - before}, cached {sum(x.num_cached_tokens for x in s)}"
    )
print(
    f"speed-up {res[False][0] / res[True][0]:.2f}x; max |diff| {max(abs(a - b) for a, b in zip(res[True][1], res[False][1])):.2e}"
)
