"""Planning an input prefix on an object store streams its listing: a page of keys at a time, footers read as
pages arrive, nothing held as a whole listing; the digest of the objects' versions is the one a full listing
gives. And a rolled part far larger than an upload block goes to the store as a multipart upload. Small
counts against the local S3 server (moto), with the page size made small; structure is asserted, never time."""

# ruff: noqa: F811 - the s3 fixture is imported from s3_server and used as an argument
from __future__ import annotations

import hashlib
import io
import os
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from s3_server import S3, s3, s3_endpoint  # noqa: F401 - fixtures

import batchgen.data.reader as reader
import batchgen.data.remote_input as ri
from batchgen.data.reader import open_input

FILES = 7


def _inputs(s3: S3) -> list[bytes]:
    out = []
    for i in range(FILES):
        t = pa.table({"prompt": [f"file {i} row {j}" for j in range(i + 1)]})
        out.append(s3.put_table(f"in/f{i:02d}.parquet", t))
    s3.put_table("in/_skip/x.parquet", pa.table({"prompt": ["no"]}))  # names starting with _ are not input
    return out


def test_a_prefix_is_listed_a_page_at_a_time_with_footers_read_as_pages_arrive(
    s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    _inputs(s3)
    monkeypatch.setattr(ri, "LIST_PAGE", 2)
    pages: list[int] = []
    first_footer = threading.Event()
    waited: list[bool] = []
    list_page, footer = ri._list_page, ri._footer

    def _list_page(fs, **kw):
        if pages:  # a later page is listed only once a footer of the first is being read: streaming
            waited.append(first_footer.wait(timeout=20))
        pages.append(len(pages))
        return list_page(fs, **kw)

    def _footer(loc, name, size):
        first_footer.set()
        return footer(loc, name, size)

    monkeypatch.setattr(ri, "_list_page", _list_page)
    monkeypatch.setattr(ri, "_footer", _footer)

    # the listing itself is lazy: its first object costs one page
    loc = ri.Location(s3.url("in"), {}, key="data.input")
    stream = ri._listing(loc.fs, loc.root)
    assert next(stream)[0].endswith("in/_skip/x.parquet") and len(pages) == 1
    pages.clear()
    first_footer.set()
    assert len(list(stream)) == FILES and len(pages) == 3  # 8 keys, 2 a page: 3 pages more
    pages.clear()
    first_footer.clear()

    inp = open_input(s3.url("in"))
    assert waited and all(waited)  # no page after the first waited for a footer in vain
    assert len(pages) == 4
    assert [f.rel_path for f in inp.files] == [f"f{i:02d}.parquet" for i in range(FILES)]
    assert [f.row_start for f in inp.files] == [i * (i + 1) // 2 for i in range(FILES)]
    assert inp.num_rows == FILES * (FILES + 1) // 2


def test_the_versions_digest_of_many_objects_is_computed_as_they_come(
    s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    _inputs(s3)
    monkeypatch.setattr(ri, "LIST_PAGE", 3)
    monkeypatch.setattr(reader, "LISTED_VERSIONS", 4)  # more objects than the manifest lists one by one
    d = open_input(s3.url("in")).describe()
    assert "versions" not in d
    listed = s3.client.list_objects_v2(Bucket=s3.bucket, Prefix="in/f")["Contents"]
    h = hashlib.sha256()
    for o in sorted(listed, key=lambda o: o["Key"]):
        h.update(f"{o['Key'][3:]}\0{o['Size']}\0{o['ETag']}\n".encode())
    assert d["versions_sha256"] == h.hexdigest()
    monkeypatch.setattr(reader, "LISTED_VERSIONS", 1000)  # few objects: each one's version
    d = open_input(s3.url("in")).describe()
    assert sorted(d["versions"]) == [f"f{i:02d}.parquet" for i in range(FILES)]


def test_a_missing_prefix_and_one_without_parquet_are_one_line(s3: S3) -> None:
    with pytest.raises(reader.InputError, match="does not exist"):
        open_input(s3.url("nothing-here"))
    s3.client.put_object(Bucket=s3.bucket, Key="txt/a.txt", Body=b"x")
    with pytest.raises(reader.InputError, match=r"contains no \*\.parquet objects"):
        open_input(s3.url("txt"))


def test_a_rolled_part_is_a_multipart_upload(s3: S3) -> None:
    """Pieces of ~4 MB rolled into one part of about three upload blocks (5 MiB each): the part reaches the
    store as a multipart upload (its ETag counts the parts), and reads back whole."""
    import batchgen.data.storage as storage
    from batchgen.data.manifest import Manifest, WindowRecord
    from batchgen.data.output_dir import open_output_dir
    from batchgen.data.part_roll import PartRoller

    windows, rows = 3, 2000
    old = storage.UPLOAD_BLOCK
    storage.UPLOAD_BLOCK = 5 << 20  # S3's least part size
    try:
        od = open_output_dir(s3.url("out"), 0, 1, {}, 30.0)
        with od:
            m = od.open(
                Manifest("fp", {}, {"fingerprint": "i"}, {"index": 0, "count": 1}, rows, windows, "t")
            )
            for w in range(windows):  # incompressible: ~2.6 MB of Parquet a window
                text = [os.urandom(1300).hex() for _ in range(rows)]
                t = pa.table({"id": range(w * rows, (w + 1) * rows), "generated_text": text})
                od.commit(w, t, WindowRecord("", w * rows, (w + 1) * rows, rows, rows, 0, 0, 0, 0))
            PartRoller(od, part_rows=10**9).finish()
            assert [(p.first, p.last) for p in m.parts] == [(0, windows - 1)]
            part = m.parts[0]
    finally:
        storage.UPLOAD_BLOCK = old
    head = s3.client.head_object(Bucket=s3.bucket, Key="out/part-000000.parquet")
    assert head["ContentLength"] == part.size > 5 << 20
    assert head["ETag"].strip('"').endswith(f"-{-(-part.size // (5 << 20))}")  # multipart: one ETag per block
    raw = s3.get("out/part-000000.parquet")
    assert hashlib.sha256(raw).hexdigest() == part.sha256
    table = pq.read_table(io.BytesIO(raw))
    assert table.column("id").to_pylist() == list(range(windows * rows))
    assert not s3.keys("out/_windows/")
