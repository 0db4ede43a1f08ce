"""Image parts in OpenAI batch chat requests on an image-text model, through the command: ``data:`` base64 URLs,
paths, ``file://`` and ``s3://`` URLs (the storage layer) give the tokens ``LLM.chat`` gives; a bad image is an
error line for its request alone; the printed summary counts the job's images."""

# ruff: noqa: F811 - the s3 fixture is imported from s3_server and used as an argument

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

pytest.importorskip("PIL", reason="image inputs need the vision extra (Pillow)")

from conftest import batchgen_cli  # noqa: E402
from s3_server import S3, s3, s3_endpoint  # noqa: E402, F401 - fixtures
from vision_helpers import png_bytes, random_image  # noqa: E402

from batchgen import LLM, SamplingParams  # noqa: E402
from batchgen.multimodal.tiny import build_llava  # noqa: E402


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> str:
    return build_llava(tmp_path_factory.mktemp("llava_batch"))


def _line(cid: str, url: str, question: str, **body) -> str:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 6,
                                "temperature": 0, **body}})  # fmt: skip


def test_image_parts_in_a_batch_file(llava: str, s3: S3, tmp_path: Path) -> None:
    a, b = png_bytes(random_image(56, 56, 3)), png_bytes(random_image(90, 60, 4))
    (tmp_path / "a.png").write_bytes(a)
    s3.client.put_object(Bucket=s3.bucket, Key="img/b.png", Body=b)
    data_url = "data:image/png;base64," + base64.b64encode(a).decode()
    lines = [
        _line("data", data_url, "What is it?"),
        _line("path", str(tmp_path / "a.png"), "What is it?"),
        _line("file", (tmp_path / "a.png").as_uri(), "Describe it."),
        _line("s3", s3.url("img/b.png"), "What is it?", n=2),
        _line("corrupt", "data:image/png;base64," + base64.b64encode(b"not a png").decode(), "What is it?"),
        _line("missing", str(tmp_path / "gone.png"), "What is it?"),
        _line("two", data_url, "What is it?").replace(
            '{"type": "text"', '{"image_url": "a.png"}, {"type": "text"'
        ),
    ]
    (tmp_path / "req.jsonl").write_text("\n".join(lines) + "\n")
    args = [f"model.path={llava}", "data.input=req.jsonl", "data.output=res.jsonl", "engine.num_blocks=256",
            "run.max_error_fraction=1", "run.progress=off", "engine.limit_mm_per_prompt={image: 1}"]  # fmt: skip
    p = batchgen_cli(args, tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    got = {x["custom_id"]: x for x in map(json.loads, (tmp_path / "res.jsonl").read_text().splitlines())}
    assert list(got) == ["data", "path", "file", "s3", "corrupt", "missing", "two"]
    assert got["corrupt"]["response"] is None and "image 0" in got["corrupt"]["error"]["message"]
    assert got["corrupt"]["error"]["code"] == got["missing"]["error"]["code"] == "invalid_image"
    assert got["missing"]["response"] is None and "gone.png" in got["missing"]["error"]["message"]
    assert "2 images but the model takes at most 1" in got["two"]["error"]["message"]
    assert got["two"]["error"]["code"] == "invalid_image"
    # the summary: image a three times, image b in both samples of "s3"; each encoded once
    assert "5 references, 2 distinct, 2 encoded" in p.stdout and "image encoder" in p.stdout

    def text(cid: str) -> list[str]:
        return [c["message"]["content"] for c in got[cid]["response"]["body"]["choices"]]

    llm = LLM(llava, kv_cache_memory="32MiB")
    convs = [json.loads(x)["body"]["messages"] for x in lines[:4]]
    convs[3][0]["content"][0]["image_url"]["url"] = str(tmp_path / "b.png")
    (tmp_path / "b.png").write_bytes(b)
    want = [
        o.outputs[0].text
        for o in llm.chat(convs, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    ]
    assert [text(c)[0] for c in ("data", "path", "file", "s3")] == want
    assert text("s3") == [want[3], want[3]]  # greedy: both samples the same
