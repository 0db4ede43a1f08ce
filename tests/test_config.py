"""Job configuration: Hydra composition, typed errors, env-driven shard defaults, help text."""

from __future__ import annotations

import dataclasses

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from batchgen.data.layout import shard_dir_name
from batchgen.engine.config import EngineConfig
from batchgen.errors import ConfigError
from batchgen.job.config import JobConfig, to_job_config
from batchgen.job.help import field_docs, help_template, option_docs, render_options
from batchgen.job.hydra_setup import register_configs, register_resolvers
from batchgen.sampling_params import SamplingParams

register_configs()
register_resolvers()


def _compose(overrides: list[str] | None = None, hydra: bool = False):
    with initialize_config_module(config_module="batchgen.conf", version_base="1.3"):
        return compose(config_name="config", overrides=overrides or [], return_hydra_config=hydra)


@pytest.fixture(autouse=True)
def _no_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_TASK_COUNT", raising=False)


def test_defaults_compose_to_job_config() -> None:
    job = to_job_config(_compose())
    assert isinstance(job, JobConfig)
    assert job.model.path is None and job.model.dtype == "auto"
    assert job.data.input is None and job.data.output == "batchgen_output"
    assert job.data.prompt_column == "prompt" and job.data.group_by_prefix is True
    assert (job.data.shard.index, job.data.shard.count) == (0, 1)
    assert isinstance(job.engine, EngineConfig)
    assert job.sampling.seed == 0 and job.sampling.max_tokens == 16


def test_overrides_are_typed_and_converted() -> None:
    job = to_job_config(
        _compose(
            [
                "data.input=x.parquet",
                "data.window_rows=64",
                "data.keep_columns=[a,b]",
                "sampling.temperature=0",
                "sampling.stop=['###']",
                "engine.max_num_seqs=8",
                "model.path=/ckpt",
            ]
        )
    )
    assert job.data.window_rows == 64 and job.data.keep_columns == ["a", "b"]
    assert job.sampling.temperature == 0.0 and job.sampling.stop == ["###"]
    assert job.engine.max_num_seqs == 8 and job.model.path == "/ckpt"


def test_greedy_sampling_group() -> None:
    assert to_job_config(_compose(["sampling=greedy"])).sampling.temperature == 0.0


def test_shard_defaults_come_from_slurm_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "8")
    job = to_job_config(_compose())
    assert (job.data.shard.index, job.data.shard.count) == (3, 8)
    assert type(job.data.shard.index) is int
    # explicit overrides win over the environment
    job = to_job_config(_compose(["data.shard.index=1", "data.shard.count=2"]))
    assert (job.data.shard.index, job.data.shard.count) == (1, 2)


def test_hydra_run_dir_is_under_the_output(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _compose(["data.output=/tmp/out", "data.shard.index=2", "data.shard.count=4"], hydra=True)
    run_dir = OmegaConf.select(cfg, "hydra.run.dir")
    assert run_dir.startswith("/tmp/out/shard-00002-of-00004/_logs/")
    assert cfg.hydra.job.chdir is False
    cfg = _compose(["data.output=out"], hydra=True)
    assert OmegaConf.select(cfg, "hydra.run.dir").startswith("out/_logs/")


def test_misspelt_key_names_it() -> None:
    with pytest.raises(ConfigCompositionException) as e:
        _compose(["data.windw_rows=3"])
    msg = str(e.value) + str(e.value.__cause__)
    assert "windw_rows" in msg


def test_wrong_type_names_it() -> None:
    with pytest.raises(ConfigCompositionException) as e:
        _compose(["data.window_rows=abc"])
    msg = str(e.value) + str(e.value.__cause__)
    assert "data.window_rows" in msg and "abc" in msg


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["data.window_rows=0"], "data.window_rows"),
        (["data.shard.index=4", "data.shard.count=4"], "data.shard.index"),
        (["data.shard.count=0"], "data.shard.count"),
        (["data.keep_columns=[status]"], "data.keep_columns"),
        (["data.keep_columns=[a,a]"], "data.keep_columns"),
        (["engine.block_size=7"], "engine.block_size"),
        (["engine.kv_cache_memory=lots"], "memory size"),
        (["model.dtype=int8"], "model.dtype"),
        (["run.progress=fancy"], "run.progress"),
        (["sampling.top_p=0"], "top_p"),
        (["sampling.n=0"], "sampling.n"),
    ],
)
def test_invalid_values_raise_config_error(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        to_job_config(_compose(overrides))


def test_sampling_group_is_sampling_params() -> None:
    cfg = _compose()
    assert set(cfg.sampling) == {f.name for f in dataclasses.fields(SamplingParams)}
    job = to_job_config(cfg)
    assert type(job.sampling) is SamplingParams
    # the job's defaults are SamplingParams' except the seed: rows are seeded by default
    assert job.sampling == SamplingParams(seed=0)
    assert to_job_config(_compose(["sampling.seed=null"])).sampling.seed is None


def test_plain_dict_of_groups_is_typed_with_the_job_defaults() -> None:
    job = to_job_config({"data": {"window_rows": 4, "shard": {"count": 2}}, "sampling": {"max_tokens": 3}})
    assert job.data.window_rows == 4 and (job.data.shard.index, job.data.shard.count) == (0, 2)
    assert job.sampling == SamplingParams(max_tokens=3, seed=0) and job.data.output == "batchgen_output"
    with pytest.raises(ConfigError, match="windw_rows"):
        to_job_config({"data": {"windw_rows": 4}})


def test_a_config_changed_after_construction_is_validated_again() -> None:
    job = JobConfig()
    job.sampling.top_p = 0.0
    with pytest.raises(ConfigError, match=r"sampling\.top_p must be in \(0, 1\]"):
        to_job_config(job)


def test_every_option_is_documented_in_help() -> None:
    opts = option_docs()
    keys = {k for k, _, _ in opts}
    for f in dataclasses.fields(EngineConfig):
        assert f"engine.{f.name}" in keys
    assert {
        "task",
        "data.shard.index",
        "data.shard.count",
        "model.path",
        "sampling.seed",
        "run.stop_grace_s",
    } <= keys
    undocumented = [k for k, _, doc in opts if not doc]
    assert not undocumented, undocumented
    text = render_options()
    for k in keys:
        assert f"  {k}=" in text
    assert "$APP_CONFIG_GROUPS" in help_template()
    assert "${" not in help_template().replace("${hydra.help.header}", "").replace("${hydra.help.footer}", "")


def test_field_docs_reads_attribute_docstrings() -> None:
    docs = field_docs(EngineConfig)
    assert "block" in docs["block_size"].lower()


def test_shard_dir_name() -> None:
    assert shard_dir_name(0, 1) == ""
    assert shard_dir_name(3, 16) == "shard-00003-of-00016"


@pytest.mark.parametrize(
    "override, named",
    [
        ("+data.windw_rows=8", "data.windw_rows (did you mean data.window_rows?)"),
        ("++sampling.temprature=0.5", "sampling.temprature (did you mean sampling.temperature?)"),
        ("+data.shard.idx=1", "data.shard.idx (did you mean data.shard.index?)"),
        ("+engine.foo=1", "engine.foo"),
        ("+nonsense=1", "nonsense"),
    ],
)
def test_unknown_keys_are_rejected_whatever_their_prefix(override: str, named: str) -> None:
    """Hydra's `+`/`++` add keys past its own check (Hydra even suggests `+data.windw_rows=8` after a typo)."""
    cfg = _compose([override])
    with pytest.raises(ConfigError, match="unknown configuration key") as e:
        to_job_config(cfg)
    assert named in str(e.value)


@pytest.mark.parametrize(
    "override, expected",
    [
        (r"sampling.stop=['\n\n']", ["\n\n"]),  # the documented form (single quotes around it in the shell)
        (r'sampling.stop=["\n\n","END"]', ["\n\n", "END"]),
        (r"sampling.stop=[\n\n]", ["\n\n"]),
        (r"sampling.stop=['\t|\r']", ["\t|\r"]),
        (r"sampling.stop=['a\\nb']", ["a\\nb"]),  # an escaped backslash: a literal backslash-n
        (r"sampling.stop=['C:\path']", ["C:\\path"]),  # unknown escapes stay as written
        (r"sampling.stop=['\u00e9\x41']", ["éA"]),
    ],
)
def test_stop_strings_spell_newlines_as_on_the_command_line(override: str, expected: list[str]) -> None:
    assert to_job_config(_compose([override])).sampling.stop == expected


def test_stop_strings_of_python_callers_are_not_decoded() -> None:
    from batchgen.job.config import JobConfig

    job = JobConfig(sampling=SamplingParams(stop=["\\n"], seed=0))
    assert to_job_config(job).sampling.stop == ["\\n"]


def test_new_run_and_data_options_are_validated() -> None:
    job = to_job_config(_compose())
    assert job.run.max_error_fraction == 0.1 and job.run.checkpoint_interval_s == 60.0
    assert job.data.retry_errors is False
    for bad, key in (("run.max_error_fraction=1.5", "run.max_error_fraction"),
                     ("run.checkpoint_interval_s=-1", "run.checkpoint_interval_s")):  # fmt: skip
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            to_job_config(_compose([bad]))
