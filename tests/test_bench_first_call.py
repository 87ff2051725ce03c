"""bench/bench_first_call.py's summary on the CPU (the measurements themselves need a GPU)."""

from __future__ import annotations

import random
import statistics

import pytest

import bench_first_call


def test_summary_takes_each_modes_median_of_every_time_and_the_table_shows_them():
    rng = random.Random()
    runs = [{"mode": mode, "kernel": kernel, **{key: rng.uniform(0.001, 10.0) for key in bench_first_call.TIMES}}
            for mode, kernel in [("jit", "jit"), ("aot", "aot"), ("jit", "jit"), ("aot", "jit"), ("jit", "jit"),
                                 ("aot", "aot")]]
    summary = bench_first_call.summarize(runs)
    table = bench_first_call.format_table(summary).splitlines()
    assert [line.split()[0] for line in table[1:]] == list(bench_first_call.MODES)
    for mode, line in zip(bench_first_call.MODES, table[1:]):
        mine = [r for r in runs if r["mode"] == mode]
        for key in bench_first_call.TIMES:
            assert summary[mode][key] == statistics.median(r[key] for r in mine)
        assert summary[mode]["kernel"] == "/".join(sorted({r["kernel"] for r in mine}))
        shown = [float(x) for x in line.split()[2:]]
        assert shown == [round(summary[mode][key], 3 if key.endswith("_ms") else 2)
                         for key in bench_first_call.TIMES]


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--steady", "0"], ["--seq-len", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        bench_first_call.parse_args(argv)
    assert "need --seq-len, --repeats and --steady >= 1" in capsys.readouterr().err
