"""A real local S3 server for the object-store tests: moto's server mode on 127.0.0.1 (no network).

``s3_endpoint`` (session) starts it once; ``s3_env`` (per test) points the AWS_* variables at it (credentials
``testing``, ``AWS_ENDPOINT_URL``, instance metadata off) and yields a helper with a fresh bucket.
"""

from __future__ import annotations

import io
import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    server_mod = pytest.importorskip("moto.server", reason="moto[server] is not installed (test extra)")
    pytest.importorskip("s3fs", reason="s3fs is not installed (test and cloud extras)")
    pytest.importorskip("boto3", reason="boto3 is not installed (test extra)")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@dataclass
class S3:
    endpoint: str
    bucket: str
    client: Any

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def put_table(self, key: str, table: pa.Table, **kwargs: Any) -> bytes:
        buf = io.BytesIO()
        pq.write_table(table, buf, **kwargs)
        self.client.put_object(Bucket=self.bucket, Key=key, Body=buf.getvalue())
        return buf.getvalue()

    def keys(self, prefix: str = "") -> list[str]:
        out = self.client.list_objects_v2(Bucket=self.bucket, Prefix=prefix).get("Contents", [])
        return sorted(o["Key"] for o in out)

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def env(self, **extra: str) -> dict[str, str]:
        """os.environ for a subprocess talking to this server."""
        env = {
            k: v for k, v in os.environ.items() if k not in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT")
        }
        env.update(S3_ENV, AWS_ENDPOINT_URL=self.endpoint, **extra)
        return env

    def parts(self, prefix: str) -> dict[str, tuple]:
        """Each part's rows and schema metadata (without num_cached_tokens), like conftest.part_contents."""
        out = {}
        for k in self.keys(prefix.rstrip("/") + "/"):
            name = k.rsplit("/", 1)[-1]
            if k.count("/") == prefix.rstrip("/").count("/") + 1 and name.startswith("part-"):
                t = pq.read_table(io.BytesIO(self.get(k)))
                out[name] = (t.drop_columns(["num_cached_tokens"]).to_pylist(), t.schema.metadata)
        return out


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> S3:
    import boto3

    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket=bucket)
    return S3(s3_endpoint, bucket, client)
