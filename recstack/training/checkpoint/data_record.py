"""What data a checkpoint trained on, so that ``--resume`` continues on that data and on no other.

A checkpoint records, under ``data_fingerprint``: every ``[data.synth]`` option (the generator's options and
seed) when the set was generated, the training set's fingerprint (``recstack.data.integrity.fingerprint``: its
row count and a SHA-256 of ``meta.json`` and both ends of every array file) and the row range trained on (which
``data.eval_fraction`` decides). A resumed run compares them with its own and stops with a ConfigError naming the
first difference, unless ``--resume-on-new-data`` says the change is meant (then it says what changed and goes
on). Checkpoints written before the record existed resume unchecked, with a note.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from recstack.data.config import DataConfig
from recstack.data.integrity import fingerprint
from recstack.data.prepared_dataset import PreparedDataset
from recstack.errors import ConfigError

KEY = "data_fingerprint"
NEW_DATA_FLAG = "--resume-on-new-data"


def data_record(d: DataConfig, train: PreparedDataset, train_rows: tuple[int, int]) -> dict[str, Any]:
    """-> {name: value} of what the run trains on (the options first: a difference names the option)."""
    record: dict[str, Any] = {}
    if d.synth:
        from recstack.data.synth.generate import SynthConfig

        options = json.loads(json.dumps(SynthConfig(**d.synth).to_dict()))  # every option, defaults included
        record.update({f"data.synth.{k}": v for k, v in sorted(options.items())})
    record["data.train"] = fingerprint(train)
    record["training rows"] = list(train_rows)
    return record


class DataRecord:
    """``data_fingerprint``: see the module docstring. ``allow_other``: ``--resume-on-new-data``; ``announce``:
    print the note (rank 0)."""

    def __init__(self, record: dict[str, Any], allow_other: bool, announce: bool) -> None:
        self.record, self.allow_other, self.announce = record, allow_other, announce

    def state_dict(self) -> dict[str, Any]:
        return {KEY: dict(self.record)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        where = state.get("path", "the checkpoint")
        saved = state.get(KEY)
        if not isinstance(saved, dict):
            if self.announce:
                print(f"note: resume: {where} records no data fingerprint (written by an older recstack): the data "
                      "is not compared with what it trained on", file=sys.stderr)
            return
        diff = difference(saved, self.record)
        if diff is None:
            return
        what = f"resume: {where} trained on other data than this run's: {diff}"
        if not self.allow_other:
            raise ConfigError(f"{what}. --resume continues only on the data its checkpoint trained on: point [data] "
                              f"at that data again, or pass {NEW_DATA_FLAG} to continue on this data")
        if self.announce:
            print(f"{what}; continuing on this run's data ({NEW_DATA_FLAG})", file=sys.stderr)


def difference(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """The first name whose value differs, as "NAME: A then, B now", or None."""
    for name in dict.fromkeys([*now, *saved]):
        then, current = saved.get(name, "<not set>"), now.get(name, "<not set>")
        if then != current:
            return f"{name}: {then!r} then, {current!r} now"
    return None
