"""Gemma 3 through batchgen: the SigLIP tower and projector, ``<start_of_image>`` placeholders expanded as the
processor writes them, image tokens attending to each other both ways during prefill; greedy output equals
transformers token for token (float32, CPU) with images of several sizes, several images per row, batched and
shuffled, with chunked prefill and prefix caching (an image's tokens never split across chunks)."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import torch_backend
from batchgen.kernels.testing import make_paged_batch

GREEDY_TOKENS = 8


def _dense_reference(batch, options, key_end: torch.Tensor) -> torch.Tensor:
    """float64: query ``t`` at position ``p`` sees keys ``k < max(p + 1, key_end[t])``, ``k > p - window``."""
    bs = batch.k_cache.shape[1]
    out = torch.empty(batch.q.shape, dtype=torch.float64)
    cu = batch.cu_seqlens_q.tolist()
    for b, n in enumerate(batch.seq_lens.tolist()):
        pos = torch.arange(n)
        slots = batch.block_tables[b, pos // bs].long() * bs + pos % bs
        k = batch.k_cache.flatten(0, 1)[slots].double()
        v = batch.v_cache.flatten(0, 1)[slots].double()
        group = batch.q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        q = batch.q[cu[b] : cu[b + 1]].double()
        qpos = torch.arange(n - q.shape[0], n)[:, None]
        allowed = (pos[None] <= qpos) | (pos[None] < key_end[cu[b] : cu[b + 1], None])
        if options.sliding_window is not None:
            allowed &= pos[None] > qpos - options.sliding_window
        s = torch.einsum("qhd,khd->hqk", q, k) * options.scale
        s = s.masked_fill(~allowed, float("-inf"))
        out[cu[b] : cu[b + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_with_bidirectional_spans_matches_float64_reference(window):
    q_lens, seq_lens = [12, 3, 9], [20, 3, 30]
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    positions = torch.cat([torch.arange(n - q, n) for q, n in zip(q_lens, seq_lens)])
    key_end = positions + 1
    key_end[2:7] = 8 + 7  # sequence 0: positions 10..14 form a span (ends at 15)
    key_end[12:14] = 2  # sequence 1: positions 0..1
    key_end[19:24] = 30  # sequence 2: its last 5 tokens
    options = batch.options(sliding_window=window)
    out = torch_backend.paged_prefill_attention(
        batch.q, batch.cu_seqlens_q, batch.kv, options, key_end=key_end
    )
    torch.testing.assert_close(out.double(), _dense_reference(batch, options, key_end), atol=1e-5, rtol=1e-5)


def test_paged_attention_takes_the_masked_prefill_for_spans_on_any_backend():
    """A mixed step (decodes, then prefill chunks) with spans: the prefill part is the torch backend's masked
    path even when the engine's backend is another (the Triton and C prefill kernels are causal only)."""
    from batchgen.attention import AttentionMetadata, PagedAttention, TorchBackend

    class CausalOnly(TorchBackend):
        name = "causal-only"

        def prefill(self, *args, **kwargs):
            raise AssertionError("a step with spans must not reach a causal-only prefill")

    q_lens, seq_lens = [1, 1, 12, 9], [7, 17, 20, 30]
    batch = make_paged_batch(seq_lens, q_lens, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    positions = torch.cat([torch.arange(n - q, n) for q, n in zip(q_lens, seq_lens)])
    tables = batch.block_tables.long()
    seq_of = torch.repeat_interleave(torch.arange(4), torch.tensor(q_lens))
    slots = tables[seq_of, positions // 8] * 8 + positions % 8
    k_new, v_new = batch.k_cache.flatten(0, 1)[slots], batch.v_cache.flatten(0, 1)[slots]
    key_end = positions + 1
    key_end[4:9] = 15  # sequence 2: positions 10..14 form a span
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decode_seqs=2,
        seq_lens=batch.seq_lens,
        cu_seqlens_q=batch.cu_seqlens_q,
        block_tables=batch.block_tables,
        max_seq_len=max(seq_lens),
        max_query_len=max(q_lens),
        key_end=key_end,
    )
    options = batch.options(sliding_window=6)
    out = PagedAttention(CausalOnly()).forward(
        batch.q, k_new, v_new, batch.k_cache, batch.v_cache, meta, options
    )
    torch.testing.assert_close(out.double(), _dense_reference(batch, options, key_end), atol=1e-5, rtol=1e-5)


def test_image_runs_stay_whole_in_chunks():
    from types import SimpleNamespace

    from batchgen.engine.features.multimodal import ImageSpans, image_runs

    item = SimpleNamespace(start=3, num_tokens=4, offsets=(1, 2, 4, 5))
    assert image_runs(item) == [(4, 6), (7, 9)]
    spans = ImageSpans([(4, 20), (30, 46)])
    seq = SimpleNamespace(num_computed_tokens=0)
    assert spans.chunk(seq, 10) == 4  # would end inside the first run: ends before it
    assert spans.chunk(seq, 4) == 4 and spans.chunk(seq, 20) == 20 and spans.chunk(seq, 25) == 25
    seq.num_computed_tokens = 4
    assert spans.chunk(seq, 10) == 0  # starts at the run and cannot finish it: waits for more budget
    assert spans.chunk(seq, 16) == 16
    seq.num_computed_tokens = 8  # inside a run (a prefix-cache hit): the rest of it whole, or nothing
    assert spans.chunk(seq, 5) == 0 and spans.chunk(seq, 12) == 12 and spans.chunk(seq, 30) == 22


pytest.importorskip("PIL", reason="image inputs need the vision extra (Pillow)")

from vision_helpers import hf_greedy, random_image  # noqa: E402

from batchgen import LLM, SamplingParams  # noqa: E402
from batchgen.multimodal.tiny import build_gemma3  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> str:
    return build_gemma3(tmp_path_factory.mktemp("gemma3"))


def _chat(text: str, n_images: int = 1) -> str:
    return f"<start_of_turn>user\n{'<start_of_image>' * n_images}{text}<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def rows_and_reference(gemma3):
    a, b, c, d = (
        random_image(w, h, s) for s, (w, h) in enumerate([(56, 56), (120, 60), (40, 90), (300, 200)])
    )
    rows = [
        (_chat("What is in the picture?"), [a]),  # the template's newline merges with the processor's
        ("Compare <start_of_image> with <start_of_image>, please.", [b, c]),
        ("<start_of_image>", [d]),
        ("No image here, only text, and long enough to pass the sliding window of the local layer.", []),
        (_chat("Two of them, and a question long enough to pass the window", 2), [c, a]),
        ("<start_of_image>", [d]),  # the same prompt again: a prefix-cache hit that ends inside the image
        ("A question long enough to push the image past a chunk's end: <start_of_image> what is it?", [b]),
    ]
    return rows, hf_greedy(gemma3, rows, GREEDY_TOKENS)


def _inputs(rows, order):
    return [
        {"prompt": rows[i][0], "multi_modal_data": {"image": rows[i][1]}} if rows[i][1] else rows[i][0]
        for i in order
    ]


def test_greedy_equals_transformers_batched_and_shuffled(gemma3, rows_and_reference):
    rows, ref = rows_and_reference
    llm = LLM(gemma3, kv_cache_memory="32MiB", max_num_seqs=8)
    order = [2, 0, 4, 6, 3, 1, 5]
    outs = llm.generate(_inputs(rows, order), GREEDY, use_tqdm=False)
    assert [o.error for o in outs] == [None] * len(rows)
    assert [o.outputs[0].token_ids for o in outs] == [ref[i] for i in order]
    stats = llm.engine.images.stats
    assert (stats.references, stats.distinct, stats.encoded) == (8, 4, 4)
    # the image matters: the same question about another image answers differently
    other = llm.generate({"prompt": rows[0][0], "multi_modal_data": {"image": rows[1][1][0]}}, GREEDY)
    assert other[0].outputs[0].token_ids != ref[0]


def test_pan_and_scan_crops_equal_transformers(gemma3):
    """``mm_processor_kwargs={"do_pan_and_scan": True}``: a wide image becomes the whole image and its crops,
    each its own run of image tokens between the processor's text; a square one stays one view; several views
    of several images encode in one batch. Greedy tokens equal transformers' with the same options."""
    wide, tall, square = random_image(200, 60, 21), random_image(50, 160, 22), random_image(56, 56, 23)
    rows = [
        (_chat("Describe."), [wide]),
        (_chat("Compare them.", 2), [square, tall]),
        (_chat("And this one?"), [square]),
    ]
    scan = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16, "pan_and_scan_max_num_crops": 3,
            "pan_and_scan_min_ratio_to_activate": 1.2}  # fmt: skip
    ref = hf_greedy(gemma3, rows, GREEDY_TOKENS, **scan)
    llm = LLM(gemma3, kv_cache_memory="32MiB", max_num_seqs=4, mm_processor_kwargs=scan)
    outs = llm.generate(_inputs(rows, [1, 0, 2]), GREEDY, use_tqdm=False)
    assert [o.error for o in outs] == [None] * 3
    assert [o.outputs[0].token_ids for o in outs] == [ref[1], ref[0], ref[2]]
    assert len(outs[1].prompt_token_ids) > 3 * 16  # the wide image's views: the whole image and its crops


def test_chunked_prefill_and_prefix_caching_keep_image_tokens_together(gemma3, rows_and_reference):
    """A token budget of 20 splits prompts into chunks, never inside an image's 16 tokens; rows run one
    after another reuse cached blocks, one ending inside an image; every row still equals transformers."""
    from batchgen.models.vision import IMAGE_ID_BASE

    rows, ref = rows_and_reference
    llm = LLM(gemma3, kv_cache_memory="32MiB", max_num_seqs=4, block_size=8, max_num_batched_tokens=20)
    chunks: list[tuple[list[int], int, int]] = []
    scheduler = llm.engine.scheduler
    real_add = scheduler._add

    def record(out, seq, num_new):
        chunks.append((seq.token_ids, seq.num_computed_tokens, num_new))
        real_add(out, seq, num_new)

    scheduler._add = record
    outs = llm.generate(_inputs(rows, range(len(rows))), GREEDY, use_tqdm=False)
    assert [o.error for o in outs] == [None] * len(rows)
    assert [o.outputs[0].token_ids for o in outs] == ref
    cut_before_image = 0
    for ids, start, n in chunks:
        end = start + n
        if 0 < end < len(ids):  # a chunk ending inside a prompt: never between two image tokens
            assert not (ids[end - 1] >= IMAGE_ID_BASE and ids[end] >= IMAGE_ID_BASE), (start, n)
            cut_before_image += ids[end] >= IMAGE_ID_BASE and n < 20
    assert cut_before_image  # some chunk did stop short of an image it could not finish
    again = llm.generate(_inputs(rows, [5, 0]), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [ref[5], ref[0]]
    assert again[0].num_cached_tokens == 16  # two blocks of the 20-token prompt: the hit ends in the image


def test_image_longer_than_the_token_budget_fails_its_row(gemma3):
    llm = LLM(gemma3, kv_cache_memory="32MiB", max_num_batched_tokens=12, max_model_len=64)
    outs = llm.generate(
        [{"prompt": "<start_of_image>", "multi_modal_data": {"image": random_image(30, 30, 1)}}, "text"],
        GREEDY,
        use_tqdm=False,
    )
    assert "engine.max_num_batched_tokens" in outs[0].error and outs[1].error is None


def test_chat_parts_and_expanded_token_ids_equal_transformers(gemma3, rows_and_reference):
    """A chat with image parts rendered by the processor's template, and the processor's own (expanded) token
    ids given as ``prompt_token_ids``: both equal transformers."""
    import base64

    from transformers import AutoProcessor
    from vision_helpers import png_bytes

    rows, ref = rows_and_reference
    a, b = random_image(70, 50, 21), random_image(50, 70, 22)
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes(b)).decode()
    conversation = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                {"type": "image_url", "image_url": {"url": data_url}},
                {"type": "image", "image": a},
                {"type": "text", "text": "please."},
            ],
        }
    ]
    llm = LLM(gemma3, kv_cache_memory="32MiB", max_num_seqs=8)
    out = llm.chat([conversation], GREEDY, use_tqdm=False)[0]
    proc = AutoProcessor.from_pretrained(gemma3)
    parts = [{"type": "image"} if p["type"] != "text" else p for p in conversation[0]["content"]]
    hf_conv = [{**conversation[0], "content": parts}]
    text = proc.apply_chat_template(hf_conv, add_generation_prompt=True)
    assert out.prompt == text and out.error is None
    assert out.outputs[0].token_ids == hf_greedy(gemma3, [(text, [b, a])], GREEDY_TOKENS)[0]
    ids = proc(text=[rows[4][0]], images=[rows[4][1]], return_tensors="pt")["input_ids"][0].tolist()
    given = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": rows[4][1]}}, GREEDY)
    assert given[0].error is None and given[0].outputs[0].token_ids == ref[4]


def test_image_job_equals_transformers(gemma3, rows_and_reference, tmp_path):
    """An image job (a list column of image paths) with prompts split into chunks: equal to transformers."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import job_config, read_parts
    from vision_helpers import png_bytes

    from batchgen.job.run import run_job

    rows, ref = rows_and_reference
    paths = []
    for i, (_, images) in enumerate(rows):
        paths.append([])
        for j, im in enumerate(images):
            p = tmp_path / f"{i}_{j}.png"
            p.write_bytes(png_bytes(im))
            paths[-1].append(str(p))
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [t for t, _ in rows], "image": paths}), inp)
    cfg = job_config(
        gemma3,
        inp,
        tmp_path / "out",
        data={"image_column": "image"},
        engine={"max_num_batched_tokens": 24, "block_size": 8},
        sampling={"max_tokens": GREEDY_TOKENS, "temperature": 0.0},
    )
    assert run_job(cfg).exit_code == 0
    got = read_parts(tmp_path / "out").to_pylist()
    assert [r["status"] for r in got] == ["ok"] * len(rows)
    assert [r["token_ids"] for r in got] == ref
