"""Credentials never reach a message: user info in URLs and secret storage options are redacted in the job's
one-line errors, and an error escaping the job is one line, never Hydra's echo of the overrides."""

# ruff: noqa: F811 - the s3 fixture is imported from s3_server and used as an argument

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from conftest import env_without_slurm, job_config
from s3_server import S3, s3, s3_endpoint  # noqa: F401 - fixtures

from batchgen.job.redact import scrub_text
from batchgen.job.run import EXIT_CONFIG, run_job

SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"


def test_url_user_info_is_scrubbed_from_any_text() -> None:
    text = f"cannot read 's3://AKIDEXAMPLE:{SECRET}@bucket/x' nor gs://tok@b/y"
    out = scrub_text(text, [])
    assert SECRET not in out and "AKIDEXAMPLE" not in out and "tok@" not in out
    assert "s3://***@bucket/x" in out


def test_credentials_in_an_output_url_never_reach_the_message(
    llama_ckpt: str, s3: S3, tmp_path: Path
) -> None:
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"]}), inp)
    for out in (f"s3://AKIDEXAMPLE:{SECRET}@no-such-bucket-x/out", f"s3://{s3.bucket}/out?sig={SECRET}"):
        cfg = job_config(llama_ckpt, inp, out, data={"storage_options": {"secret": SECRET}})
        res = run_job(cfg, handle_signals=False, print_summary=False)
        assert res.exit_code in (EXIT_CONFIG, 75, 0), res.message
        assert SECRET not in (res.message or "") and "AKIDEXAMPLE" not in (res.message or "")


def test_an_error_escaping_the_job_is_one_line_without_the_overrides(tmp_path: Path) -> None:
    # a resolver that fails inside the job's config: the error escapes run_job's own handling
    env = env_without_slurm()
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run(
        [sys.executable, "-m", "batchgen.cli", "data.input=${oc.env:BATCHGEN_NO_SUCH_VAR}",
         f"data.output={tmp_path}/out", f"+data.storage_options.secret={SECRET}", "hydra.run.dir=.",
         "hydra.output_subdir=null"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and SECRET not in text, text[-2000:]
    assert "Error executing job with overrides" not in text and "Traceback" not in text, text[-2000:]
