"""The CLI: listings, and bad input ending in one line on stderr, exit 2, no traceback."""

import os
import subprocess
import sys

import pytest

import kvpolicy
from kvpolicy.cli import main


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvpolicy", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_presets_lists_presets_and_components():
    result = run_cli("presets")
    assert result.returncode == 0, result.stderr
    for name in kvpolicy.PRESETS:
        assert f"  {name} " in result.stdout
    for component in ("query_cosine", "every_step", "interval", "kmeans", "pages", "segments", "top_budget", "bound",
                      "analytic", "nearest_centroid", "collision_rerank"):
        assert component in result.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["run", "--preset", "louis"], "unknown preset 'louis'; known presets: full, streaming"),
        (["run", "--preset", "quest", "--budget", "0"], "budget must be a positive integer"),
        (["run", "--preset", "quest", "--budget", "-3"], "budget must be a positive integer"),
        (["run", "--preset", "louiskv", "--budget", "50"], "must exceed sink + local"),
        (["run", "--preset", "louiskv", "--backend", "triton"], "backend 'triton'"),
        (["run", "--preset", "louiskv", "--backend", "cudnn"], "accepted: auto, reference, triton"),
        (["run", "--preset", "louiskv", "--model", "/no/such/model"], "/no/such/model"),
        (["run", "--preset", "louiskv", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--plugin", "no_such_plugin_module", "presets"], "cannot import plugin module 'no_such_plugin_module'"),
        (["calibrate", "--length", "512", "--budget", "512"], "covers the whole 512-token prompt"),
        (["calibrate", "--taus", "0.5,1.5"], "--taus must be numbers in [-1, 1]"),
        (["eval", "--tasks", "nope"], "unknown task 'nope'; known tasks:"),
        (["eval", "--presets", "full,louis"], "unknown preset 'louis'"),
        (["eval", "--presets", "full,la", "--variant", "la=louiskv:{"], "--variant la: options are not valid JSON"),
        (["eval", "--presets", "la", "--variant", "la=louiskv"], "--variant takes LABEL=PRESET:JSON"),
        (["fidelity", "--presets", "quest,nope"], "unknown preset 'nope'"),
        (["fidelity", "--budget", "10"], "must exceed sink + local"),
        (["drift", "--policies", "pariskv,nope"], "unknown drift policy 'nope'; known: streaming"),
        (["drift", "--temperature", "-1"], "--temperature must be >= 0"),
        (["drift", "--policies", "pariskv", "--budget", "60"], "must exceed sink + local"),
        (["calibrate", "--tolerance", "2"], "--tolerance must be in [0, 1]"),
        (["calibrate", "--outliers", "3"], "outliers is read by estimate 'outlier' only"),
        (["calibrate", "--estimate", "outlier", "--measure", "weakest"], "estimate 'outlier' needs measure 'mass'"),
        (["calibrate", "--against", "anchor"], "--against anchor is an experiment"),
        (["calibrate", "--merge", "/no/such/shard.json"], "cannot read calibration shard '/no/such/shard.json'"),
        (["calibrate", "--samples", "4", "--steps", "16"], "= 64 tokens; a stored choice needs at least 200"),
        (["bench", "layer", "--backend", "reference", "--presets", "louiskv@disk"],
         "the placement after '@' must be one of cpu, gpu\n"),
        # one layer alone has no split to make; e2e runs it
        (["bench", "layer", "--backend", "reference", "--presets", "louiskv@split"],
         "'louiskv@split': the placement after '@' must be one of cpu, gpu\n"),
        (["bench", "e2e", "--backend", "reference", "--presets", "louiskv@disk"],
         "the placement after '@' must be one of cpu, gpu, split"),
        (["bench", "e2e", "--backend", "reference", "--placements", "cpu,nvme"], "--placements takes cpu, gpu, split"),
        (["bench", "e2e", "--backend", "reference", "--presets", "louiskv,@cpu"], "names no preset"),
        (["bench", "e2e", "--backend", "reference", "--query-pull", "1,x"], "--query-pull takes comma-separated numbers"),
    ],
)
def test_bad_input_exits_2_without_traceback(args, message, monkeypatch, capsys):
    # in this process (a process a case costs seconds of imports on CI's CPU); an exception that escaped
    # main would fail the test here as a traceback would there. test_bad_input_in_a_process_... runs the module.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # so "--backend triton" cannot run on this CPU
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    captured = capsys.readouterr()
    assert code == 2, (captured.out, captured.err)
    assert message in captured.err


@pytest.mark.parametrize("args,message", [
    (["run", "--preset", "louis"], "unknown preset 'louis'; known presets: full, streaming"),  # kvpolicy's own error
    (["run", "--preset", "louiskv", "--backend", "cudnn"], "accepted: auto, reference, triton"),  # argparse's
])
def test_bad_input_in_a_process_exits_2_with_one_line_and_no_traceback(args, message, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    result = run_cli(*args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_tau_out_of_range_from_python_config_is_a_clear_error():
    with pytest.raises(kvpolicy.ConfigError, match=r"\[-1, 1\]"):
        kvpolicy.Policy.from_dict({"preset": "louiskv", "trigger": {"name": "query_cosine", "tau": 2}})


def test_readme_test_command_is_what_ci_runs():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    readme = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    ci = open(os.path.join(root, ".ci", "run"), encoding="utf-8").read()
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv") and "pytest" in line]
    assert len(commands) == 1
    assert commands[0] in ci.splitlines()


def test_bench_rows_name_each_presets_placements_and_reach_the_json_as_they_come(tmp_path):
    from argparse import Namespace

    from kvpolicy.cli.bench import BenchRows, preset_placements

    args = Namespace(presets="louiskv,arkvale@cpu,quest@gpu,pariskv@split", placements="cpu,gpu")
    assert preset_placements(args) == [("louiskv", ["cpu", "gpu"]), ("arkvale", ["cpu"]), ("quest", ["gpu"]),
                                       ("pariskv", ["split"])]
    path = tmp_path / "rows.json"
    rows = BenchRows(str(path), {"device": "cpu"})
    rows.append({"kind": "a"})
    import json

    assert json.loads(path.read_text())["rows"] == [{"kind": "a"}]  # written before the run ends
    rows.append({"kind": "b"})
    assert [r["kind"] for r in json.loads(path.read_text())["rows"]] == ["a", "b"]
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"]  # the partial file was renamed over it


def test_graph_replay_timing_needs_a_cuda_device():
    import torch

    from kvpolicy.bench.timing import time_replay_ms

    with pytest.raises(ValueError, match="needs a CUDA device"):
        time_replay_ms(lambda: None, torch.device("cpu"))


@pytest.mark.parametrize("argv, leaving, more", [
    ([], "ignored", {}), (["--leaving", "unheld"], "unheld", {}),
    (["--estimate", "outlier", "--outliers", "4", "--group", "each"], "ignored",
     {"estimate": "outlier", "outliers": 4, "group": "each"}),
])
def test_calibrate_measures_score_gap_with_the_presets_leaving_rule(argv, leaving, more, monkeypatch):
    # the built-in louiskv trigger ignores tokens that left the window; a calibration the user runs
    # must measure (and store) the same rule unless told otherwise
    import kvpolicy.cli
    import kvpolicy.eval.calibrate as calibrate
    import kvpolicy.models as models

    class Stop(Exception):
        pass

    seen = {}

    def measure(*args, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(models, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(calibrate, "measure_taus", measure)
    with pytest.raises(Stop):
        kvpolicy.cli.main(["calibrate", "--trigger", "score_gap", "--device", "cpu", *argv])
    assert seen["options"] == {"measure": "mass", "leaving": leaving, **more}
