"""Image sources, content hashes and the error of each bad-image case (batchgen.multimodal.images)."""

# ruff: noqa: F811 - the s3 fixture is imported from s3_server and used as an argument

from __future__ import annotations

import base64
import io

import pytest

pytest.importorskip("PIL", reason="image inputs need the vision extra (Pillow)")
from PIL import Image  # noqa: E402
from s3_server import s3, s3_endpoint  # noqa: E402, F401 - fixtures

from batchgen.multimodal.images import ImageError, ImageLoader  # noqa: E402


def _png(color=(10, 200, 30), size=(24, 16), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


def test_every_source_decodes_and_same_bytes_hash_the_same(tmp_path):
    data = _png()
    path = tmp_path / "a.png"
    path.write_bytes(data)
    loader = ImageLoader()
    sources = [
        data,
        str(path),
        f"file://{path}",
        "data:image/png;base64," + base64.b64encode(data).decode(),
        {"bytes": data, "path": None},
        {"bytes": None, "path": str(path)},
        path,  # an os.PathLike
    ]
    loaded = [loader.load(s) for s in sources]
    assert {im.hash for im in loaded} == {loaded[0].hash}
    assert all(im.size == (24, 16) and im.image.mode == "RGB" for im in loaded)
    assert loader.load(_png(color=(11, 200, 30))).hash != loaded[0].hash
    # a PIL image is hashed by its pixels: the same picture twice is one image, another picture is not
    pil = loader.load(Image.new("RGBA", (5, 5), (1, 2, 3, 255)))
    assert pil.hash == loader.load(Image.new("RGB", (5, 5), (1, 2, 3))).hash
    assert pil.hash != loader.load(Image.new("RGB", (5, 5), (1, 2, 4))).hash


def test_object_store_urls_go_through_the_storage_layer():
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    fs.pipe("/imgs/x.png", _png())
    loader = ImageLoader()
    assert loader.load("memory://imgs/x.png").size == (24, 16)
    with pytest.raises(ImageError, match="no such object"):
        loader.load("memory://imgs/missing.png")


def test_s3_images_through_a_local_s3_server(s3):
    data = _png(color=(1, 2, 3))
    s3.client.put_object(Bucket=s3.bucket, Key="imgs/a.png", Body=data)
    loader = ImageLoader()
    assert loader.load(s3.url("imgs/a.png")).hash == ImageLoader().load(data).hash
    with pytest.raises(ImageError, match="no such object"):
        loader.load(s3.url("imgs/none.png"))


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        (b"not an image at all", "unknown or unsupported image format"),
        (_png()[:60], "corrupt or truncated"),
        (b"", "empty"),
        ("/nonexistent/dir/img.png", "no such file"),
        ("https://example.com/a.png", "http\\(s\\) URLs are not fetched"),
        ("data:image/png;base64,@@@", "invalid base64"),
        ({"bytes": None, "path": None}, "neither 'bytes' nor 'path'"),
        (12, "unsupported image value of type int"),
    ],
)
def test_bad_images_are_clear_errors(source, reason):
    with pytest.raises(ImageError, match=reason):
        ImageLoader().load(source)


def test_pixel_limit_and_reduced_jpeg_decoding():
    big = _png(size=(400, 300), fmt="JPEG")
    with pytest.raises(ImageError, match="exceeds the limit"):
        ImageLoader(max_pixels=1000).load(big)
    small = ImageLoader(target_side=50).load(big)  # decoded at a reduced scale (JPEG draft), not whole
    assert small.size[0] < 400 and min(small.size) >= 100
    assert small.hash == ImageLoader().load(big).hash  # the hash is of the bytes, whatever the decode scale


def test_text_only_use_never_imports_pillow():
    import subprocess
    import sys

    code = (
        "import sys, batchgen, batchgen.llm, batchgen.job.run, batchgen.multimodal.inputs, "
        "batchgen.multimodal.rows, batchgen.engine.core.llm_engine; print('PIL' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_prompts_are_prepared_ahead_in_order_first_two_then_chunks_up_to_eight():
    import threading

    from batchgen.multimodal.prepare import chunk_bounds, prepare_ahead

    assert chunk_bounds(20) == [(0, 2), (2, 6), (6, 14), (14, 20)]  # the engine starts on the first two
    assert chunk_bounds(1) == [(0, 1)] and chunk_bounds(0) == []
    seen, lock = [], threading.Lock()

    def make_many(items):
        with lock:
            seen.append(len(items))
        return [i * 10 for i in items]

    futures = prepare_ahead(make_many, list(range(20)))
    assert [f.result(timeout=30) for f in futures] == [i * 10 for i in range(20)]
    assert sorted(seen) == [2, 4, 6, 8]


def test_prompts_showing_the_same_images_are_prepared_in_the_same_task(monkeypatch):
    """The chunks of prepare_ahead's ``order`` and of the job's prepare hold whole sets of prompts showing the
    same image (a path by its text, bytes by the object), and results come back in the prompts' order."""
    import threading

    from batchgen.multimodal import prepare

    a, b, c = _png((1, 1, 1)), _png((2, 2, 2)), _png((3, 3, 3))
    images = [[a], ["x.png"], [b], [a], [{"bytes": None, "path": "x.png"}], [b], [c], [a], [c], [b]]
    order = prepare.by_images(images)
    keys = [prepare.source_key(images[i]) for i in order]
    assert sorted(order) == list(range(10)) and keys == sorted(keys)
    assert prepare.source_key([a]) != prepare.source_key([bytes(bytearray(a))])  # another object: not known
    assert prepare.source_key([{"bytes": a, "path": "y.png"}]) == prepare.source_key([a])  # read by its bytes
    monkeypatch.setattr(prepare, "_WORKERS", 2)
    tasks, lock = [], threading.Lock()

    def make_many(items):
        with lock:
            tasks.append({prepare.source_key(images[i]) for i in items})
        return [i * 10 for i in items]

    futures = prepare.prepare_ahead(make_many, list(range(10)), ramp=False, order=order)
    assert [f.result(timeout=30) for f in futures] == [i * 10 for i in range(10)]
    assert sum(len(t) for t in tasks) <= 4 + len(tasks) - 1  # each image's prompts in one task, or split once

    class Side:  # prepare_many's side: records what each task was given
        def build_many(self, items):
            with lock:
                tasks.append([ims for _, ims in items])
            return [f"{ids[0]}" for ids, _ in items]

    tasks.clear()
    many = [([i], images[i % 10]) for i in range(40)]
    assert prepare.prepare(Side(), many) == [str(i) for i in range(40)]
    assert len(tasks) == 6 and all(len(t) <= prepare.CHUNK for t in tasks)


def test_the_same_bytes_object_is_hashed_once_within_the_memo_budget(monkeypatch):
    import hashlib

    from batchgen.multimodal import images as images_module

    data, other = _png((5, 6, 7)), _png((8, 9, 10))
    calls = []
    real = hashlib.sha256
    monkeypatch.setattr(images_module.hashlib, "sha256", lambda d: calls.append(len(d)) or real(d))
    loader = ImageLoader()
    first = [loader.read(data).hash for _ in range(3)] + [loader.read({"bytes": data, "path": None}).hash]
    assert first == [real(data).hexdigest()] * 4 and len(calls) == 1
    copy = bytes(bytearray(data))  # equal content, another object: hashed again, to the same digest
    assert loader.read(copy).hash == first[0] and len(calls) == 2
    monkeypatch.setattr(images_module, "DIGEST_MEMO_BYTES", len(data) + len(other) - 1)
    loader = ImageLoader()
    loader.read(data), loader.read(other), loader.read(data)  # the budget holds one: data was evicted
    assert len(calls) == 5 and loader._memo_bytes <= images_module.DIGEST_MEMO_BYTES


def test_a_cpu_engine_waits_for_the_images_it_has_room_for_split_evenly(monkeypatch):
    """On the CPU the preparing threads share the engine's cores: the tasks are even (the workers finish
    together) and the engine is busy only once it holds as many requests as it has room for; an accelerator's
    engine steps whenever it has work."""
    from types import SimpleNamespace

    import torch

    from batchgen.multimodal import prepare

    monkeypatch.setattr(prepare, "_WORKERS", 2)
    assert prepare.chunk_bounds(16, ramp=False) == [(0, 8), (8, 16)]
    assert prepare.chunk_bounds(20, ramp=False) == [(0, 5), (5, 10), (10, 15), (15, 20)]
    assert prepare.chunk_bounds(3, ramp=False) == [(0, 1), (1, 3)]
    assert prepare.chunk_bounds(1, ramp=False) == [(0, 1)] and prepare.chunk_bounds(0, ramp=False) == []
    held = [0]
    engine = SimpleNamespace(
        device=torch.device("cpu"),
        config=SimpleNamespace(max_num_seqs=3),
        num_unfinished=lambda: held[0],
        has_unfinished=lambda: held[0] > 0,
    )
    busy = prepare.engine_busy(engine)
    assert prepare.shares_cores(engine) and not busy()
    held[0] = 2
    assert not busy()  # room for one more: its images are waited for
    held[0] = 3
    assert busy()
    engine.device = torch.device("meta")  # any device that is not the CPU's cores
    held[0] = 1
    assert not prepare.shares_cores(engine) and prepare.engine_busy(engine)()


def test_relative_paths_are_read_from_the_base_then_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "data" / "img").mkdir(parents=True)
    (tmp_path / "data" / "img" / "a.png").write_bytes(_png(color=(1, 1, 1)))
    (tmp_path / "b.png").write_bytes(_png(color=(2, 2, 2)))
    monkeypatch.chdir(tmp_path)
    loader = ImageLoader(base=str(tmp_path / "data"))
    assert loader.load("img/a.png").hash == ImageLoader().load(_png(color=(1, 1, 1))).hash
    assert loader.load({"bytes": None, "path": "img/a.png"}).hash == loader.load("img/a.png").hash
    assert loader.load("b.png").hash == ImageLoader().load(_png(color=(2, 2, 2))).hash  # not under the base
    with pytest.raises(
        ImageError, match=r"'img/none.png': no such file in the input's directory \(.*/data\)"
    ):
        loader.load("img/none.png")
    with pytest.raises(ImageError, match="no such file"):
        ImageLoader().load("img/a.png")  # without a base: the working directory only


def test_a_null_image_is_named_as_such():
    with pytest.raises(ImageError, match="null image value"):
        ImageLoader().load(None)


def test_a_numpy_array_of_pixels_is_one_image():
    """An ``H x W x C`` uint8 array (as vLLM and transformers take it) is one image, in multi_modal_data and in
    a chat part; an array of another dtype is a clear error."""
    import numpy as np

    from batchgen.multimodal.chat import split_images
    from batchgen.multimodal.inputs import as_image_list

    pixels = np.random.default_rng(0).integers(0, 255, (16, 24, 3), dtype=np.uint8)
    assert len(as_image_list(pixels)) == 1 and len(as_image_list([pixels, pixels])) == 2
    loaded = ImageLoader().load(pixels)
    assert loaded.size == (24, 16) and loaded.hash == ImageLoader().load(Image.fromarray(pixels)).hash
    _, images = split_images([{"role": "user", "content": [{"type": "image_pil", "image_pil": pixels}]}])
    assert images[0] is pixels
    with pytest.raises(ImageError, match="uint8"):
        ImageLoader().load(pixels.astype(np.float32))


def test_exif_orientation_turns_the_image_upright_as_vllm_and_load_image_do(tmp_path):
    import numpy as np
    from PIL import ImageOps
    from transformers.image_utils import load_image

    rng = np.random.default_rng(5)
    img = Image.fromarray(rng.integers(0, 255, (40, 90, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: shown turned 90 degrees clockwise
    path = tmp_path / "sideways.jpg"
    img.save(path, format="JPEG", exif=exif.tobytes())
    want = np.asarray(load_image(str(path)))
    assert want.shape == (90, 40, 3)  # upright: the stored width is its height
    loader = ImageLoader()
    for source in (str(path), path.read_bytes(), Image.open(path)):
        got = loader.load(source)
        assert np.array_equal(np.asarray(got.image), want), type(source)
    plain = tmp_path / "plain.jpg"  # no orientation tag: the pixels as stored
    img.save(plain, format="JPEG")
    assert np.array_equal(
        np.asarray(loader.load(str(plain)).image),
        np.asarray(ImageOps.exif_transpose(Image.open(plain)).convert("RGB")),
    )
