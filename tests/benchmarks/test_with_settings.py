"""benchmarks/with_settings.py sets existing module constants, then runs a script as __main__."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tool(benchmark_script):
    return benchmark_script("with_settings")


def test_sets_a_constant_then_runs_the_script_with_its_arguments(tool, tmp_path, monkeypatch):
    from kvpolicy.kernels.triton import rerank_select

    monkeypatch.setattr(rerank_select, "METHOD", "auto")
    monkeypatch.setattr(rerank_select, "_RADIX_SCORE_SUB", rerank_select._RADIX_SCORE_SUB)
    script = tmp_path / "show.py"
    out = tmp_path / "seen.txt"
    script.write_text(
        "import sys\nfrom kvpolicy.kernels.triton import rerank_select as r\n"
        f"open({str(out)!r}, 'w').write(repr((r.METHOD, r._RADIX_SCORE_SUB, sys.argv[1:])))\n"
    )
    monkeypatch.setattr("sys.argv", ["x"])
    tool.main(["kvpolicy.kernels.triton.rerank_select.METHOD=radix",
               "kvpolicy.kernels.triton.rerank_select._RADIX_SCORE_SUB=64", "--", str(script), "--flag", "7"])
    assert out.read_text() == repr(("radix", 64, ["--flag", "7"]))


@pytest.mark.parametrize("argv, message", [
    (["kvpolicy.kernels.triton.rerank_select.METHOZ=radix", "--", "x.py"], "has no 'METHOZ' to set"),
    (["METHOD", "--", "x.py"], "expected MODULE.NAME=VALUE"),
])
def test_names_a_bad_setting(tool, argv, message):
    with pytest.raises(SystemExit, match=message):
        tool.main(argv)
