"""What the command line reads before Hydra: ``--version`` is batchgen's, and ``sampling.stop`` takes a single
string as ``--help`` says (Hydra's typed config alone refuses it: "str is not a ListConfig")."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

import batchgen
from batchgen.job.cli_args import single_strings_as_lists


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
