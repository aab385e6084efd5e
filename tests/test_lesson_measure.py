"""The lessons' timing helper (minillm/course/measure.py): interleaved rounds, median and range, the load,
the reference figure beside the student's, and the verdict when a measured ordering contradicts a lesson."""
import os

import pytest

from minillm.course import measure
from minillm.course.measure import Spread, beside_reference, check, faster, interleaved, load_line
from minillm.resources import current_figures


def test_contestants_take_turns_round_by_round_after_one_warmup_each():
    calls = []
    spreads = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3)
    assert calls == ["a", "b"] + ["a", "b"] * 3          # a burst of load hits both, not one whole series
    assert set(spreads) == {"a", "b"} and all(len(s.samples) == 3 for s in spreads.values())
    with pytest.raises(ValueError):
        interleaved({"a": lambda: None}, rounds=0)


def test_a_spread_is_its_median_and_range():
    s = Spread((0.030, 0.010, 0.020, 0.100))
    assert (s.median, s.low, s.high) == (0.025, 0.010, 0.100)
    assert s.ms() == "25.0 (10.0-100.0)"
    assert s.rate() == "40.0 (10.0-100.0)"             # tok/s from s/token: the fastest round is the highest rate


def test_a_contradicting_ordering_is_reported_with_the_load_not_concluded(capsys, monkeypatch):
    monkeypatch.setattr(measure, "load_average", lambda: 3.5)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    spreads = {"MQA": Spread((0.040, 0.041, 0.060)), "GQA": Spread((0.030, 0.031, 0.050))}
    assert not faster(spreads, "MQA", "GQA", "MQA decodes faster than GQA")
    out = capsys.readouterr().out
    assert out.startswith("NOT what the lesson says") and "contradicts \"MQA decodes faster than GQA\"" in out
    assert "Load average 3.50 on 2 cores" in out and "load is the likely cause" in out
    assert "MQA 41.0 (40.0-60.0) ms vs GQA 31.0 (30.0-50.0) ms" in out
    assert "as the lesson says" not in out


def test_an_ordering_that_agrees_is_stated_as_the_lesson_says(capsys):
    spreads = {"MQA": Spread((0.020,)), "GQA": Spread((0.030,))}
    assert faster(spreads, "MQA", "GQA", "MQA decodes faster than GQA")
    out = capsys.readouterr().out
    assert out.startswith("as the lesson says: MQA decodes faster than GQA") and "NOT" not in out


def test_on_an_idle_machine_the_contradiction_is_not_blamed_on_load(capsys, monkeypatch):
    monkeypatch.setattr(measure, "load_average", lambda: 0.1)
    check("a point stays under the roof", False, "prefill at 120% of the roof")
    out = capsys.readouterr().out
    assert "NOT what the lesson says" in out and "load is the likely cause" not in out and "run it again" in out


def test_the_load_line_warns_only_when_the_cores_were_busy(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(measure, "load_average", lambda: 0.5)
    assert load_line() == "load average 0.50 (1 min) on 2 cores"
    monkeypatch.setattr(measure, "load_average", lambda: 4.2)
    assert load_line(start=1.0).startswith("load average 1.00 -> 4.20 (1 min) on 2 cores: other work")


def test_the_reference_beside_yours_is_the_current_figure():
    figure = next(f for f in current_figures() if f["key"] == "cpu.speculative.ngram")
    line = beside_reference("cpu.speculative.ngram", 1.234)
    assert line.startswith("yours: 1.23 x | reference: ")
    assert f"{figure['values']['minillm']:,} x on {figure['machine']}, {figure['date']}" in line
    assert beside_reference("cpu.ttft512.smollm2.fp32.2-threads", 6051.7).startswith("yours: 6,052 ms")
    with pytest.raises(KeyError):
        beside_reference("no.such.figure", 1.0)
