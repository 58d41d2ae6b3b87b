"""benchmarks/pick_options.py and the device driver's `options` -> `A` hand-over
(benchmarks/run_rollout_h200.sh), with a stand-in for generate_throughput.py's GPU runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from benchmark_scripts import BENCH, load_script

pick_options = load_script(BENCH / "pick_options.py")


def _line(speed, options=None, *, system="native", workload="A", batch=256):
    record = {"system": system, "workload": workload, "batch": batch, "output_tokens_per_s": speed}
    if options:
        record["kernel_options"] = options
    return json.dumps(record)


def _runs(*lines):
    return pick_options.results(list(lines), "A", 256)


def test_results_keep_the_successful_native_runs_of_the_workload_and_batch():
    lines = [
        _line(100.0),
        _line(90.0, {"triton_decode.HEADS_PER_PROGRAM": 2}),
        json.dumps({"system": "native", "workload": "A", "batch": 256, "error": "OutOfMemoryError"}),
        _line(500.0, system="hf_static"),
        _line(500.0, batch=64),
        _line(500.0, workload="B"),
        "[options] rc=0 (61 s)",
    ]
    assert pick_options.results(lines, "A", 256) == [
        ({}, 100.0),
        ({"triton_decode.HEADS_PER_PROGRAM": 2}, 90.0),
    ]


def test_pick_takes_the_fastest_run_only_above_the_noise():
    swiglu, heads = {"triton_swiglu.IN_DECODE": True}, {"triton_decode.HEADS_PER_PROGRAM": 2}
    runs = _runs(_line(100.0), _line(102.0, swiglu), _line(101.5, heads))
    assert pick_options.pick(runs, 0.01)[0] == swiglu
    assert pick_options.pick(runs, 0.03)[0] == {}  # 2% is within a 3% noise floor
    # two default runs: their mean is the baseline (102 is 0.5% above 101.5)
    runs = _runs(_line(100.0), _line(103.0), _line(102.0, swiglu))
    assert pick_options.pick(runs, 0.01)[0] == {}
    with pytest.raises(ValueError, match="defaults"):
        pick_options.pick(_runs(_line(102.0, swiglu)), 0.01)


def test_union_joins_the_winners_and_says_when_they_were_measured_already():
    prefetch = {"triton_decode.PREFETCH_TABLE": True, "triton_decode.NUM_STAGES": 3}
    stages4 = {"triton_decode.NUM_STAGES": 4}
    cdf, slow = {"triton_sampler.METHOD": "cdf"}, {"triton_linear.MAX_ROWS": 256}
    runs = _runs(
        _line(100.0), _line(104.0, prefetch), _line(103.0, stages4), _line(102.0, cdf), _line(99.0, slow)
    )
    together, notes = pick_options.union(runs, 0.01)
    assert together == {**prefetch, **cdf}  # NUM_STAGES=4 clashes with the faster run's 3
    assert any("left out" in n and "NUM_STAGES=4" in n for n in notes)
    assert pick_options.union(_runs(_line(100.0), _line(104.0, prefetch), _line(99.0, slow)), 0.01)[0] == {}
    # the set measured together is then a run like any other
    done = _runs(_line(100.0), _line(104.0, prefetch), _line(102.0, cdf), _line(106.0, {**prefetch, **cdf}))
    assert pick_options.union(done, 0.01)[0] == {}
    assert pick_options.pick(done, 0.01)[0] == {**prefetch, **cdf}


def test_words_read_back_through_the_benchmarks_option_parser():
    generate = load_script(BENCH / "generate_throughput.py")
    options = {
        "triton_decode.HEADS_PER_PROGRAM": 2,
        "triton_swiglu.IN_DECODE": True,
        "triton_sampler.METHOD": "cdf",
    }
    text = pick_options.words(options)
    assert text == "triton_decode.HEADS_PER_PROGRAM=2 triton_sampler.METHOD=cdf triton_swiglu.IN_DECODE=True"
    value, recorded = generate.kernel_options_from(text.split())
    assert recorded == options
    assert value.decode.heads_per_program == 2 and value.sampler.method == "cdf" and value.swiglu.in_decode


# generate_throughput.py's stand-in: one native record per run at a speed set by its options
FAKE_GENERATE = """
import json, sys
args = sys.argv[1:]
options = args[args.index("--kernel-option") + 1:] if "--kernel-option" in args else []
systems = args[args.index("--systems") + 1:]
systems = systems[:next((i for i, a in enumerate(systems) if a.startswith("--")), len(systems))]
gain = {"triton_swiglu.IN_DECODE=True": 3.0, "triton_decode.HEADS_PER_PROGRAM=2": 2.0,
        "triton_sampler.METHOD=cdf": -4.0}
with open("calls.txt", "a") as f:
    f.write(" ".join(args) + "\\n")
for system in systems:
    record = {"system": system, "workload": "A", "batch": 256}
    if system == "native":
        record["output_tokens_per_s"] = 100.0 + sum(gain.get(o, 0.0) for o in options)
        if options:
            record["kernel_options"] = dict(o.split("=") for o in options)
    print(json.dumps(record))
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_driver_measures_the_winners_together_and_hands_the_pick_to_part_a(tmp_path):
    tree = tmp_path / "tree"
    (tree / "benchmarks").mkdir(parents=True)
    for name in ("run_rollout_h200.sh", "parts_lib.sh", "pick_options.py"):
        shutil.copy(BENCH / name, tree / "benchmarks" / name)
    (tree / "benchmarks" / "generate_throughput.py").write_text(FAKE_GENERATE)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    options = "triton_swiglu.IN_DECODE=True triton_decode.HEADS_PER_PROGRAM=2 triton_sampler.METHOD=cdf"

    def driver(out, **extra):
        return subprocess.run(["bash", "benchmarks/run_rollout_h200.sh", str(tmp_path / out)], cwd=tree,
                              env={**env, **extra}, capture_output=True, text=True, timeout=120)  # fmt: skip

    missing = driver("out0", PARTS="A", A_OPTIONS="picked")
    assert missing.returncode == 2 and "PARTS=options first" in missing.stderr
    done = driver("out1", PARTS="options", OPTIONS=options)
    assert done.returncode == 0, done.stderr
    calls = (tree / "calls.txt").read_text().splitlines()
    assert len(calls) == 5  # the defaults, three options alone, the two winners together
    assert calls[-1].endswith(
        "--kernel-option triton_decode.HEADS_PER_PROGRAM=2 triton_swiglu.IN_DECODE=True"
    )
    picked = "triton_decode.HEADS_PER_PROGRAM=2 triton_swiglu.IN_DECODE=True\n"
    assert (tmp_path / "out1" / "options.picked").read_text() == picked
    assert (tree / ".bench" / "picked_options").read_text() == picked
    done = driver("out2", PARTS="A", A_OPTIONS="picked", A_SYSTEMS="native hf_static")
    assert done.returncode == 0, done.stderr
    last = (tree / "calls.txt").read_text().splitlines()[-1]
    assert last.endswith("--systems native hf_static --kernel-option " + picked.strip())
    records = [json.loads(line) for line in (tmp_path / "out2" / "A.jsonl").read_text().splitlines()]
    assert [r["system"] for r in records] == ["native", "hf_static"]
    assert records[0]["output_tokens_per_s"] == 105.0
    # no time left in the part's budget: no run starts, and the earlier pick is not left behind
    skipped = driver("out3", PARTS="options", OPTIONS=options, OPTIONS_BUDGET_S="-1")
    assert skipped.returncode == 0 and "the defaults skipped" in skipped.stderr
    assert "no successful run with the defaults" in skipped.stderr and "Traceback" not in skipped.stderr
    assert len((tree / "calls.txt").read_text().splitlines()) == 6  # no new run
    assert not (tree / ".bench" / "picked_options").exists()
    # no run with the defaults succeeded: no pick is left for part A to take silently
    (tree / ".bench" / "picked_options").write_text(picked)
    (tree / "benchmarks" / "generate_throughput.py").write_text("import sys; sys.exit(1)\n")
    done = driver("out4", PARTS="options", OPTIONS=options)
    assert done.returncode == 0 and not (tree / ".bench" / "picked_options").exists()
    assert "no successful run with the defaults" in done.stderr


def test_the_gpu_tests_cover_each_option_the_driver_measures():
    """The `options` part's default entries are the option sets `test_native_gpu` compiles and checks."""
    import re

    from native_cases import KERNEL_OPTIONS

    driver = (BENCH / "run_rollout_h200.sh").read_text()
    default = re.search(r"\$\{OPTIONS:-([^}]*)\}", driver)
    assert default is not None
    entries = default.group(1).replace("\\\n", " ").split()
    measured = [dict(word.split("=") for word in entry.split("+")) for entry in entries]
    tested = [{k: str(v) for k, v in opt.items()} for name, opt in KERNEL_OPTIONS.items() if name != "all"]
    assert measured == tested
