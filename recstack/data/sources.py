"""Which rows a run trains and evaluates on: the prepared sets named by ``[data]``, the held-out tail, and the
``[data.synth]`` set generated on the way (again when the one found was generated with other options).

No collectives here: under torchrun the training layer passes ``prepare_data`` a ``coordinate`` that runs the
generation on one rank while the others wait.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path

from recstack.data.config import DataConfig
from recstack.data.integrity import check_values
from recstack.data.prepared_dataset import PreparedDataset, layout_difference
from recstack.errors import ConfigError
from recstack.io import read_json


def prepare_data(
    d: DataConfig, output_dir: Path | None, progress: bool = True,
    coordinate: Callable[[Callable[[], None], str], None] | None = None, keep: str | None = None,
) -> tuple[PreparedDataset, PreparedDataset, tuple[int, int]]:
    """-> (train set, eval set, eval row range). Generates the synthetic set first when ``[data.synth]``, by
    calling ``coordinate(generation, what it does)`` (default: run it here). An eval set must have the training
    set's layout (features, tables and their sizes); the eval range may be empty (no evaluation). Every set's
    values are scanned once (``integrity.check_values``), through ``coordinate`` as well: one rank reads them.
    ``keep``: a synthetic set found generated with other options is not generated again but an error ending with
    this reason (a resumed run's checkpoints trained on the set that is there)."""
    train_path = d.train
    if d.synth:
        if not train_path:
            if output_dir is None:
                raise ValueError("data.synth needs data.train or an output directory to write into")
            train_path = str(output_dir / "data")
        generation = functools.partial(synthesize, d, Path(train_path), progress, keep)
        if coordinate is None:
            generation()
        else:
            coordinate(generation, f"generate [data.synth] into {train_path}")
    if not train_path:
        raise ValueError("data.train: no training data given (a prepared directory, or a [data.synth] table)")
    train = PreparedDataset(train_path)
    run = coordinate or (lambda work, what: work())
    run(functools.partial(check_values, train), f"check the values of {train.path}")
    if d.eval:
        ev = PreparedDataset(d.eval)
        run(functools.partial(check_values, ev), f"check the values of {ev.path}")
        diff = layout_difference(train, ev)
        if diff is not None:
            raise ValueError(
                f"data.eval {ev.path} was prepared with a different layout than data.train {train.path}: {diff} "
                "(train vs eval). Prepare the evaluation data with the training data's statistics (one prepare "
                "with a split, --stats-from the training output, or the same Criteo --max-ind-range) so that ids "
                "mean the same rows"
            )
        return train, ev, (0, len(ev))
    return train, train, held_out_rows(len(train), d.eval_fraction)


def held_out_rows(rows: int, eval_fraction: float) -> tuple[int, int]:
    """The evaluation rows of a training set without ``data.eval``: its last ``int(rows * eval_fraction)``."""
    n_eval = int(rows * eval_fraction)
    return rows - n_eval, rows


def synthesize(d: DataConfig, path: Path, progress: bool = True, keep: str | None = None) -> None:
    """Generate ``[data.synth]`` into ``path`` unless it already holds a set generated with these options (with
    ``keep``, a set generated with other options there is a ConfigError ending with that reason)."""
    from recstack.data.synth.generate import SynthConfig, generate

    want = SynthConfig(**d.synth)
    meta = path / "meta.json"
    overwrite = False
    if meta.is_file():
        try:
            info = read_json(meta, ValueError).get("info", {})
        except (ValueError, AttributeError):
            info = {}
        if not isinstance(info, dict) or info.get("generator") != "recstack.data.synth":
            raise ValueError(f"{path} holds a data set that [data.synth] did not generate; not overwriting it "
                             "(point data.train elsewhere, or remove [data.synth] to train on it)")
        have, now = info.get("config"), json.loads(json.dumps(want.to_dict()))  # as meta.json holds them
        if have == now:
            return
        changed = sorted(k for k, v in now.items() if not isinstance(have, dict) or have.get(k) != v)
        if keep is not None:
            was = ", ".join(f"{k} {have.get(k)!r} there, {now[k]!r} now" if isinstance(have, dict) else k
                            for k in changed)
            raise ConfigError(f"{path} was generated with other [data.synth] options ({was}): {keep}")
        print(f"{path}: generated with other [data.synth] options ({', '.join(changed)} differ); generating it "
              "again", file=sys.stderr)
        overwrite = True
    generate(want, path, progress=progress, overwrite=overwrite)
