"""Soak sizes and kill counts, from the environment with CI's values as defaults.

| variable | default (CI) | what it sizes |
| --- | --- | --- |
| `TIERSTORE_TEST_WRITEBACK_KILLS` | 100 | kills of the writer and the agent, writer on the Python API |
| `TIERSTORE_TEST_WRITEBACK_RUN_KILLS` | 20 | the same, writer under `tierstore run` |
| `TIERSTORE_TEST_WRITEBACK_OUTAGE_S` | 6 | seconds the store refuses writes in the outage test |
| `TIERSTORE_TEST_STREAM_SOAK_UPDATES` | 10000 | versions published to one consumer in the stream soak (2 or more) |
| `TIERSTORE_TEST_STREAM_IN_PLACE_UPDATES` | 200 | versions written into a model served in place (2 or more) |
| `TIERSTORE_TEST_EVICTION_READS` | 300 | reads by each of 6 threads of a cache that evicts under them |
| `TIERSTORE_TEST_EXIT_RUNS` | 16 | runs of the README's streaming example, 4 at a time, that must all exit 0 |

For instance `TIERSTORE_TEST_WRITEBACK_KILLS=1000 make test-python` for a longer soak, or `=10` for a quick
look. The values are read once, when the tests are collected: every test then runs with every
`TIERSTORE_*` variable removed (tests/conftest.py), and tierstore itself refuses a `TIERSTORE_*` variable
it does not know.
"""

from __future__ import annotations

import os

PREFIX = "TIERSTORE_TEST_"


def _count(name: str, default: int, minimum: int = 1) -> int:
    raw = os.environ.get(PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(
            f"${PREFIX}{name} = {raw!r}: give a whole number of at least {minimum} (default {default})"
        )
    return value


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(
            f"${PREFIX}{name} = {raw!r}: give a number of seconds, 0 or more (default {default})"
        )
    return value


WRITEBACK_KILLS = _count("WRITEBACK_KILLS", 100)
WRITEBACK_RUN_KILLS = _count("WRITEBACK_RUN_KILLS", 20)
WRITEBACK_OUTAGE_S = _seconds("WRITEBACK_OUTAGE_S", 6.0)
STREAM_SOAK_UPDATES = _count("STREAM_SOAK_UPDATES", 10_000, minimum=2)
STREAM_IN_PLACE_UPDATES = _count("STREAM_IN_PLACE_UPDATES", 200, minimum=2)
EVICTION_READS = _count("EVICTION_READS", 300)
EXIT_RUNS = _count("EXIT_RUNS", 16)
