"""The one schema of a reported value: its name and how micro-batches and ranks combine it.

A loss report (one micro-batch's, from the objectives: training/update.reduce_report) and a metrics dict (one
rank's, logging.reduce_metrics) map keys to values; a key is a `Stat`, or a plain name, which is a mean. What
each reduction means:

- mean: the report's entry is a [sum, count] pair, summed over micro-batches and ranks, then divided (a count
  of 0 divides by 1); a metric is averaged over the ranks that have it (NaN: none measured).
- sum: summed (a report's entry: a scalar count).
- max, min: the extreme over every element of every micro-batch and rank (NaN when none has one).
- fault: a count of bad inputs (algorithms/objective.py), summed and then raised as one error on every rank
  (raise_input_faults), never logged.

The reduced value is named by `Stat.name` alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union, get_args

How = Literal["mean", "sum", "max", "min", "fault"]


@dataclass(frozen=True, order=True)
class Stat:
    name: str
    how: How = "mean"

    def __post_init__(self):
        if self.how not in get_args(How):
            raise ValueError(f"Stat({self.name!r}): unknown reduction {self.how!r} (known: {', '.join(get_args(How))})")


Key = Union[str, Stat]


def stat(key: Key) -> Stat:
    """A report or metrics key as its Stat (a plain name: a mean)."""
    return key if isinstance(key, Stat) else Stat(key)


def by_reduction(keys) -> dict[str, list[Stat]]:
    """The keys as Stats, sorted (every rank orders them alike), grouped by reduction."""
    out: dict[str, list[Stat]] = {h: [] for h in get_args(How)}
    for s in sorted(stat(k) for k in keys):
        out[s.how].append(s)
    return out


class Reduced(dict):
    """A reduced report: its metrics by name, with its fault counts apart (`faults`: name -> count)."""

    def __init__(self, metrics=(), faults=None):
        super().__init__(metrics)
        self.faults = dict(faults or {})
