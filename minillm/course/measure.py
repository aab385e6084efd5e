"""Timing in a lesson that tells the truth on a busy laptop: the load, the spread, the reference, the verdict.

Other work on the same cores slows whatever runs at that moment. So a lesson that compares things
(GQA against MQA, drafts against plain decoding) times them in interleaved rounds, A B C A B C ..., so a
burst of load hits every contestant alike, and reports each as its median with the min-max range of
the rounds. It prints the 1-minute load average beside the numbers, and the project's own figure for
the same quantity (lessons/BENCHMARKS.md) beside the student's. When the measured ordering contradicts
what the lesson teaches, `check` says so, and that load is the likely cause, instead of a conclusion
the numbers do not support.

    spreads = interleaved({"GQA": step_gqa, "MQA": step_mqa}, rounds=5)   # {name: Spread}, seconds
    print(load_line())
    check("MQA decodes faster than GQA at 4k", spreads["MQA"].median < spreads["GQA"].median,
          f"MQA {spreads['MQA'].ms()} ms vs GQA {spreads['GQA'].ms()} ms")
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

from minillm.resources import figure as current_figure

BUSY = 1.0      # load average per core above which timings on it are taken as disturbed


def load_average() -> float:
    """The 1-minute load average: how many runnable processes shared the cores, on average (0.0 where the
    OS does not say)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):         # Windows has no load average
        return 0.0


def load_line(start: float | None = None) -> str:
    """'load average 1.84 (1 min) on 2 cores' (with `start`: 'load average 0.40 -> 1.84 ...'), and a warning
    when the cores were busy, so a reader weighs the timings next to it."""
    cores, now = os.cpu_count() or 1, load_average()
    span = f"{start:.2f} -> {now:.2f}" if start is not None else f"{now:.2f}"
    busy = max(now, start or 0.0) > BUSY * cores
    return (f"load average {span} (1 min) on {cores} cores"
            + (": other work shared the cores, so times are slower and noisier than on an idle machine"
               if busy else ""))


@dataclass(frozen=True)
class Spread:
    """Repeated timings of one thing, in seconds: its median and its range."""
    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def low(self) -> float:
        return min(self.samples)

    @property
    def high(self) -> float:
        return max(self.samples)

    def format(self, scale: float = 1e3, digits: int = 1) -> str:
        """'26.2 (25.8-31.0)': median (min-max), in seconds × scale (ms by default)."""
        f = lambda x: f"{x * scale:,.{digits}f}"
        return f"{f(self.median)} ({f(self.low)}-{f(self.high)})"

    def per(self, count: float = 1.0) -> float:
        """The median as a rate: `count` things done per median second (tok/s from a run of count tokens)."""
        return count / self.median

    def ms(self, digits: int = 1) -> str:
        return self.format(1e3, digits)

    def rate(self, per: float = 1.0, digits: int = 1) -> str:
        """The spread as a rate, per / seconds (tok/s from seconds per token): median (min-max); the
        slowest sample is the lowest rate."""
        f = lambda x: f"{per / x:,.{digits}f}"
        return f"{f(self.median)} ({f(self.high)}-{f(self.low)})"


def interleaved(contestants: dict[str, Callable[[], object]], rounds: int = 5,
                warmup: bool = True) -> dict[str, Spread]:
    """Time every contestant once a round, in turn, for `rounds` rounds -> {name: Spread of seconds}.
    One untimed warm-up call each first (the first touch of weights and caches is not what we measure)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if warmup:
        for fn in contestants.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in contestants}
    for _ in range(rounds):
        for name, fn in contestants.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: Spread(tuple(s)) for name, s in samples.items()}


def check(take_away: str, holds: bool, measured: str) -> bool:
    """Print whether this run supports the lesson's take-away. When it does not, say so, with the load
    average, instead of a conclusion the numbers do not support. Returns `holds`."""
    if holds:
        print(f"as the lesson says: {take_away} (measured: {measured})")
    else:
        cores, now = os.cpu_count() or 1, load_average()
        cause = ("load is the likely cause: other work on the cores slowed some rounds more than others"
                 if now > 0.5 * cores else
                 "the load was low, so this machine may really behave differently; run it again to see")
        print(f"NOT what the lesson says: measured {measured}, which contradicts \"{take_away}\". "
              f"Load average {now:.2f} on {cores} cores: {cause}. Rerun on an idle machine "
              f"(close other programs; `uptime` shows the load) before drawing a conclusion.")
    return holds


def faster(spreads: dict[str, Spread], quick: str, slow: str, take_away: str) -> bool:
    """check() that `quick`'s median time is below `slow`'s, the two spreads printed as the evidence."""
    return check(take_away, spreads[quick].median < spreads[slow].median,
                 f"{quick} {spreads[quick].ms()} ms vs {slow} {spreads[slow].ms()} ms, median (min-max)")


def beside_reference(key: str, yours: float, engine: str = "minillm") -> str:
    """'yours: 21.3 tok/s | reference: 23.4 tok/s on 2 cores, ... (lessons/BENCHMARKS.md)': the project's
    current figure `key` (data/current_figures.json) next to this machine's number in the same unit."""
    figure = current_figure(key)
    unit = figure["unit"]
    return (f"yours: {_number(yours)} {unit} | reference: {figure['values'][engine]:,} {unit} on {figure['machine']}, "
            f"{figure['date']} ({figure['figure']}; lessons/BENCHMARKS.md)")


def _number(x: float) -> str:
    """Three significant digits, with thousands separators and no exponent: 6,052 / 23.4 / 0.118."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"
