"""What the command line reads before Hydra: ``--version`` is batchgen's, ``sampling.stop`` takes a single
string as ``--help`` says (Hydra's typed config alone refuses it: "str is not a ListConfig"), and a misspelt key
or a value of the wrong type is one line naming it (the command's exit 2: tests/test_cli.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

import batchgen
from batchgen.job.cli_args import override_problem, single_strings_as_lists


def _value(arg: str):
    return OverridesParser.create().parse_overrides([arg])[0].value()


@pytest.mark.parametrize(
    ("arg", "want"),
    [
        ("sampling.stop=END", ["END"]),
        ("+sampling.stop=###", ["###"]),
        ("sampling.stop=it's", ["it's"]),
        ("sampling.stop=END\\", ["END\\"]),
        ("sampling.stop=\\n\\n", ["\\n\\n"]),  # escapes stay for batchgen to decode
        ("sampling.stop= two words ", [" two words "]),
        ("sampling.stop='quoted'", ["quoted"]),
        ('sampling.stop=["a","b"]', ["a", "b"]),
        ("sampling.stop=null", None),
    ],
)
def test_a_single_stop_string_becomes_a_list(arg: str, want) -> None:
    (rewritten,) = single_strings_as_lists([arg])
    assert _value(rewritten) == want


def test_other_arguments_and_sweeps_are_untouched() -> None:
    argv = ["data.output=out", "sampling.stop=A,B", "-m", "sampling.temperature=0,1", "--cfg", "job"]
    assert single_strings_as_lists(argv) == argv


def test_version_is_batchgens() -> None:
    code = "import sys; sys.argv = ['batchgen', '--version']; from batchgen.cli import main; main()"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"batchgen {batchgen.__version__}", out


def _problem(*argv: str) -> str | None:
    from batchgen.cli import _schema  # registers the ConfigStore entries

    return override_problem(list(argv), _schema())


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (
            ["data.windw_rows=5"],
            "unknown configuration key: data.windw_rows (did you mean data.window_rows?)",
        ),
        (
            ["engine.max_num_seq=4"],
            "unknown configuration key: engine.max_num_seq (did you mean engine.max_num_seqs?)",
        ),
        (["datta.window_rows=5"], "unknown configuration key: datta (did you mean data?)"),
        (["-m", "engine.max_num_seq=1,2"], "did you mean engine.max_num_seqs?"),
        (
            ["data.window_rows=abc"],
            "data.window_rows=abc: Value 'abc' of type 'str' could not be converted to Integer",
        ),
        (
            ["sampling.temperature=hot"],
            "sampling.temperature=hot: Value 'hot' of type 'str' could not be converted",
        ),
        (
            ["sampling.max_tokens=1.5"],
            "sampling.max_tokens=1.5: Value '1.5' of type 'float' could not be converted",
        ),
        (["data.window_rows=null"], "data.window_rows=null: field 'data.window_rows' is not Optional"),
    ],
)
def test_a_refused_override_is_one_line_naming_it(argv: list[str], want: str) -> None:
    got = _problem(*argv, "data.output=out")
    assert got is not None and want in got and "\n" not in got, got


def test_valid_overrides_and_what_hydra_reports_pass_through() -> None:
    assert _problem(
        "task=embed", "sampling=greedy", "data.input=x.parquet", "data.keep_columns=[a,b]", "sampling.seed=null",
        "data.storage_options.endpoint_url=http://127.0.0.1:5000", "model.lora_modules={a: /x}",
        "data.output=out/${hydra:job.num}", "hydra.run.dir=/tmp/x", "+data.windw_rows=5", "~sampling.stop",
        "-m", "data.window_rows=1,2", "engine.kv_cache_memory=4GiB", "--cfg", "job", "data.input=[",
    ) is None  # fmt: skip
