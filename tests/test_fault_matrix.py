"""The fault matrix: every fault case of the hardening work and the test that covers it, in one place; and, in
this module, the SIGKILL cases no other module covers (``data prepare``, ``data synth``, a checkpoint write), as
real ``recstack`` processes killed at the moment that matters.

Each test asserts the exact error text (a stable fragment), a time bound for the process to end (a subprocess
timeout, not a performance figure) and that no data or checkpoint was lost or corrupted.

Case -> test (``module::name`` under tests/), for every case of the hardening work (a heading per part):

1. Crafted files run no code
- crafted DCP ``.metadata`` (eval, predict):
    training/test_checkpoint_security.py::test_crafted_dcp_metadata_runs_nothing_in_eval_or_predict
- crafted ``.metadata`` under ``torchrun --resume``:
    training/test_checkpoint_security.py::test_torchrun_resume_skips_a_crafted_checkpoint
- crafted ``trainer.pt`` / ``rank_*.pt``:
    training/test_checkpoint_security.py::test_crafted_sharded_torch_files_run_nothing
- crafted ``ckpt_*.pt``:
    training/test_checkpoint_security.py::test_crafted_single_process_checkpoint_runs_nothing
- crafted tiered ``state.pt`` / table file:
    test_fault_matrix.py::test_a_crafted_tiered_checkpoint_file_runs_nothing
- crafted ExFM snapshot:
    training/test_checkpoint_security.py::test_crafted_exfm_snapshot_runs_nothing
- crafted serving artifact (``dense.pt2`` with a pickled entry, table ``.npy`` of objects):
    serving/test_artifact_security.py::test_a_crafted_artifact_file_runs_nothing_in_recstack_serve
- crafted ExFM stream checkpoint on resume:
    exfm/test_exfm_stream.py::test_resume_skips_a_crafted_checkpoint_naming_it_and_runs_nothing

2. Hangs between ranks
- stopped peer, all-to-all timeout:
    distributed/test_rank_faults.py::test_stopped_rank_fails_the_other_within_the_timeout
- killed rank:
    distributed/test_dist_checkpoint.py::test_dead_rank_stops_the_others_with_a_clear_error
- rank 0 stopped while it generates ``[data.synth]`` data (the others wait on its heartbeats):
    distributed/test_rank_faults.py::test_ranks_wait_for_rank0_on_heartbeats
- NCCL: its backend, ``dist.timeout_s`` and the watchdog setting (a unit test: no GPU here):
    distributed/test_device_placement.py::test_init_on_cuda_takes_nccl_with_the_timeout_on_every_group
- different batch sizes:
    distributed/test_rank_faults.py::test_ranks_with_different_batch_sizes_stop_at_start
- different shardings:
    distributed/test_rank_faults.py::test_ranks_with_different_shardings_stop_at_start
- different data / plans:
    distributed/test_rank_faults.py::test_ranks_with_different_data_stop_at_start
    distributed/test_rank_faults.py::test_ranks_with_different_plans_stop_at_start
- different world layouts (ranks per node, ``--resume`` on one rank):
    distributed/test_rank_faults.py::test_ranks_with_different_world_layouts_stop_at_start
- first difference named:
    distributed/test_rank_faults.py::test_first_difference_names_the_first_field_and_groups_the_ranks

3. Checkpoints
- flipped byte (single, tiered, sharded):
    training/test_checkpoint_faults.py::test_a_flipped_byte_is_refused_naming_the_file
- truncated table file:
    training/test_checkpoint_faults.py::test_a_truncated_table_file_is_refused_naming_the_file
- sharded eval falls back:
    training/test_checkpoint_faults.py::test_sharded_eval_falls_back_to_the_newest_intact_checkpoint
- sharded resume falls back (truncated ``trainer.pt`` or ``.metadata``) / none readable:
    training/test_checkpoint_faults.py::test_sharded_resume_falls_back_and_stops_when_none_is_readable
- single resume, none readable:
    training/test_checkpoint_faults.py::test_single_resume_with_no_readable_checkpoint_is_an_error_that_changes_nothing
- refused resume changes nothing:
    training/test_checkpoint_faults.py::test_a_refused_resume_leaves_the_run_directory_as_it_was
- SIGKILL during training, resume (also tiered: distributed/test_tiered_checkpoint.py):
    training/test_train.py::test_sigkill_then_resume_matches_uninterrupted
- SIGKILL during a checkpoint write:
    test_fault_matrix.py::test_sigkill_during_a_checkpoint_write_resumes_from_the_last_good_one

4. Data and numerics
- labels outside {0, 1}:
    data/test_prepared_checks.py::test_a_label_other_than_0_or_1_names_file_and_row
- NaN/Inf inputs:
    data/test_prepared_checks.py::test_a_non_finite_dense_input_names_file_row_and_feature
- ``num_rows`` that disagrees:
    data/test_prepared_checks.py::test_num_rows_that_disagrees_with_the_arrays
- bad data through ``train`` / ``eval`` / ``predict``:
    data/test_prepared_checks.py::test_recstack_train_refuses_bad_data_with_one_line
    data/test_prepared_checks.py::test_recstack_eval_and_predict_refuse_bad_rows_they_would_score
- finite divergence:
    training/test_divergence.py::test_a_finite_divergence_stops_the_run_and_leaves_no_checkpoint_of_it
- non-finite weight never checkpointed:
    training/test_divergence.py::test_a_non_finite_weight_is_never_checkpointed
- divergence under torchrun:
    training/test_divergence.py::test_under_torchrun_every_rank_stops_at_the_same_step

5. Resume after the data changed
- other ``[data.synth]`` options:
    training/test_resume_data.py::test_other_synth_options_are_refused_before_the_data_is_generated_again
- other prepared set behind the same path:
    training/test_resume_data.py::test_another_prepared_set_behind_the_same_path_is_refused
- refused resume keeps ``config.json``:
    training/test_resume_data.py::test_a_resume_refused_for_another_reason_changes_nothing
- under torchrun, ``--resume-on-new-data``:
    training/test_resume_data_torchrun.py::test_under_torchrun_every_rank_refuses_and_the_flag_lets_them_go_on

6. Disk faults
- full disk during a checkpoint:
    training/test_disk_faults.py::test_a_full_disk_during_a_checkpoint_keeps_the_last_good_one
- full disk during a sharded checkpoint:
    training/test_disk_faults_sharded.py::test_a_full_disk_during_a_sharded_checkpoint
- ``predict`` on a full disk:
    training/test_disk_faults.py::test_predict_on_a_full_disk_leaves_no_tmp
- ``prepare`` on a full disk:
    training/test_disk_faults.py::test_prepare_on_a_full_disk_leaves_no_tmp
- ``data synth --out`` / ``plan --out`` on a full disk:
    training/test_disk_faults.py::test_synth_and_plan_on_a_full_disk_leave_nothing
- read-only place, every writer:
    training/test_disk_faults.py::test_every_writer_on_a_read_only_place_fails_at_once
- ``prepare --out <file> --overwrite``:
    training/test_disk_faults.py::test_prepare_over_an_existing_file_fails_before_the_work

7. Smaller cases
- ``meta.json`` without ``arrays``:
    data/test_prepared_checks.py::test_meta_json_without_a_required_key_names_file_and_key
- negative table size:
    data/test_prepared_checks.py::test_a_negative_table_size_names_the_feature
- ``bottom_mlp=[]`` with dense features:
    training/test_run_outputs.py::test_an_empty_bottom_mlp_with_dense_features_is_a_config_error
- truncated gzip libFM / CSV file:
    data/test_input_faults.py::test_a_truncated_gzip_libfm_file_names_the_file
    data/test_input_faults.py::test_a_truncated_gzip_csv_file_names_the_file
- invalid UTF-8:
    data/test_input_faults.py::test_invalid_utf8_names_the_file_and_line
- changed dtype:
    data/test_prepared_checks.py::test_a_dtype_of_the_same_size_changed_in_meta_json
- bad multi-hot offsets:
    data/test_prepared_checks.py::test_bad_multi_hot_offsets_name_file_and_row
- dead ExFM DAS:
    exfm/test_exfm_faults.py::test_a_dead_das_is_one_clear_error
- SIGKILL of the DAS mid-run:
    exfm/test_exfm_das.py::test_killed_das_restarts_without_duplicates_or_gaps
- orphaned ExFM workers (runner killed):
    exfm/test_exfm_faults.py::test_a_killed_runner_leaves_no_helper_running
- hidden / non-data files in a day directory:
    data/test_input_faults.py::test_a_directory_of_day_files_gives_only_its_data_files
- final checkpoint written twice; evals on console:
    training/test_run_outputs.py::test_each_checkpoint_is_written_once_and_evaluations_reach_the_console
- ``eval`` names its checkpoint; relative data paths:
    training/test_run_outputs.py::test_eval_names_the_checkpoint_and_finds_relative_data_from_anywhere
- absurd model sizes:
    training/test_run_outputs.py::test_a_table_too_large_for_memory_is_an_error_before_allocating

Round 3, part A: crashes by signal, lost or wrong results, the metadata unpickler
- ``export`` to a disk that fills up (SIGBUS, SIGABRT, a ``.<out>.tmp-*`` left):
    training/test_disk_space.py::test_export_to_a_disk_that_fills_up
- ``memory.ssd_dir`` filling up under torchrun (SIGABRT, no path named):
    training/test_disk_space.py::test_an_ssd_dir_that_fills_up_under_torchrun
- ``train.threads=100000`` (SIGSEGV), ``serve --threads``:
    training/test_run_outputs.py::test_a_thread_count_past_the_bound_is_an_error_not_a_crash
- ranks with other ``--output-dir``s, ``--overwrite`` on one rank (removed the earlier run first):
    distributed/test_rank_faults.py::test_other_output_dirs_or_overwrite_stop_before_removing
- ``train.seed`` / ``train.shuffle_window`` changed at a mid-epoch ``--resume``:
    training/test_resume_data.py::test_an_order_option_changed_mid_epoch_is_refused
- ``best.json`` naming a checkpoint outside the run or of another step (eval, predict, export):
    training/test_checkpoint_faults.py::test_a_best_json_that_names_another_checkpoint_is_refused
- Parquet 1e308 (``-inf`` in prepared data):
    data/test_readers_bad.py::test_a_double_beyond_float32_is_a_bad_row_not_an_infinity
- damaged ExFM task ``result.json`` (blocked every rerun):
    exfm/test_exfm_faults.py::test_a_damaged_task_result_is_named_and_the_task_runs_again
- a prepared file cut short in place while ``train`` reads it through memory maps (SIGBUS):
    data/test_prepared_checks.py::test_a_file_cut_short_under_training_is_an_error_not_sigbus
- ``.metadata`` setting ``pathlib.PosixPath.__fspath__`` (BUILD on a class), then a KeyError:
    training/test_checkpoint_security.py::test_metadata_patching_a_class_is_refused
    training/test_checkpoint_security.py::test_the_metadata_reader_sets_nothing_on_any_class

8. The scoring service (``recstack serve``)
- hostile bodies (5,000-digit integers, 100,000-deep nesting, numbers past float32 or int64):
    serving/test_server_inputs.py::test_hostile_json_is_a_400_naming_the_field
- a non-finite score (and the status counted as sent):
    serving/test_server_inputs.py::test_a_non_finite_score_is_a_422_and_counted_as_sent
- fuzzed bodies over HTTP:
    serving/test_server_inputs.py::test_fuzzed_bodies_never_get_a_5xx
- table files truncated under a running server:
    serving/test_server_lifecycle.py::test_table_files_changed_under_a_running_server_change_nothing
- a misnumbered or refused version directory:
    serving/test_server_lifecycle.py::test_watcher_refuses_a_misnumbered_directory_once_and_no_refusal_blocks_newer
- a damaged published delta, a delta on a base that is not in use (refused once, the old version served):
    serving/test_publish.py::test_server_follows_deltas_refuses_damage_and_wrong_base_recovers_on_full
- a delta on a base of the same number from another run, or with no base:
    serving/test_publish.py::test_a_served_root_whose_newest_version_is_a_delta_starts_on_its_chain
- SIGTERM with requests in flight / under keep-alive load:
    serving/test_server_lifecycle.py::test_sigterm_drains_answering_requests_in_flight_and_exits_0
    serving/test_server_lifecycle.py::test_sigterm_under_keep_alive_load_answers_every_request_sent
- a stalled request body:
    serving/test_server_lifecycle.py::test_a_stalled_body_gets_408_and_does_not_delay_shutdown

SIGKILL during prepare / synth
- SIGKILL during ``data prepare``:
    test_fault_matrix.py::test_sigkill_during_prepare_leaves_nothing_a_train_accepts
- SIGKILL during ``data synth``:
    test_fault_matrix.py::test_sigkill_during_synth_leaves_nothing_a_train_accepts

Round 3, part B: any input gives a result or one line (exit 2; 3 for a peer), never a traceback
- corrupt gzip (``zlib.error``), CSV through prepare and inspect, libFM through inspect:
    test_one_line_errors.py::test_a_corrupt_gzip_file_names_the_file
    test_one_line_errors.py::test_a_corrupt_gzip_libfm_file_names_the_file_in_inspect
- random bytes in a CSV file (undecodable rows; a header ``csv`` refuses: ``_csv.Error``):
    test_one_line_errors.py::test_random_bytes_in_a_csv_file_name_the_file
- a TOML config nested 100,000 deep (``RecursionError``) or not UTF-8; an override too deep:
    test_one_line_errors.py::test_a_damaged_config_file_names_the_file
    test_one_line_errors.py::test_an_override_nested_too_deeply_names_it
- ``meta.json`` nested 100,000 deep or not UTF-8, ``num_embeddings`` a string,
  ``arrays.labels.file`` outside the prepared set (relative or absolute):
    test_one_line_errors.py::test_a_damaged_meta_json_names_the_file_and_key
- a ``recstack plan --tables`` file nested 100,000 deep or not UTF-8 (``dist.plan``: the same):
    test_one_line_errors.py::test_a_damaged_table_file_for_plan_names_the_file
- a ``recstack serve`` request body nested 30,000 deep (a RecursionError, HTTP 500 before):
    serving/test_server.py::test_bad_requests_are_refused_naming_the_field
- a top MLP of 10^8 units (an allocator error before):
    test_one_line_errors.py::test_an_absurd_mlp_width_is_an_error_before_allocating
- a config typo on one rank only (the other rank: ``DistStoreError`` at the timeout before):
    distributed/test_rank_faults.py::test_a_typo_on_one_rank_stops_the_others_with_its_error
- a killed ExFM task worker (``BrokenProcessPool``):
    exfm/test_exfm_faults.py::test_a_killed_task_worker_is_one_clear_error
- ``data inspect --infer-schema`` to a read-only place (failed only after the work):
    training/test_disk_faults.py::test_infer_schema_to_a_read_only_place_fails_before_the_work
- ``train.checkpoint_every`` without ``--output-dir`` (a warning before the work; the run goes on):
    test_one_line_errors.py::test_checkpoint_every_without_an_output_dir_is_said
- bounded fuzz (hypothesis) of the libFM, CSV/TSV, Parquet, Criteo TSV readers, meta.json, configs:
    data/test_reader_fuzz.py (every test; ``RECSTACK_FUZZ_EXAMPLES=N`` for a longer run)
"""

from __future__ import annotations

import json
import pickle
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import RECSTACK, SMALL, Payload, count_checkpoints, run_cli, snapshot_files, train_args

from recstack.training.checkpoint.single import list_checkpoints

TESTS = Path(__file__).resolve().parent
END = 120  # seconds any process here gets to end: a bound on hangs, not a performance figure


def criteo_tsv(path: Path, rows: int) -> Path:
    """A raw Criteo Kaggle file: label, 13 integers, 26 hex categories per line (enough rows that preparing it
    takes a few seconds)."""
    rng = np.random.default_rng(0)
    labels = (rng.random(rows) < 0.3).astype(int)
    ints, cats = rng.integers(0, 50, (rows, 13)), rng.integers(0, 2000, (rows, 26))
    path.write_text("".join("\t".join([str(y), *map(str, i), *(f"{c:08x}" for c in cc)]) + "\n"
                            for y, i, cc in zip(labels, ints, cats, strict=True)))
    return path


def kill_when(args: list[str], ready: Callable[[], bool]) -> subprocess.Popen[str]:
    """Start ``recstack ARGS``, SIGKILL it as soon as ``ready()`` holds -> the ended process (its returncode is
    -SIGKILL unless it finished first)."""
    proc = subprocess.Popen([*RECSTACK, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + END
    while not ready() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=END)
    return proc


def refused_by_train(data: Path, tmp_path: Path) -> None:
    """``recstack train`` on ``data`` (and on its ``.tmp``) stops at once with one line: not a prepared set."""
    for path in (data, data.with_name(data.name + ".tmp")):
        res = run_cli(train_args(tmp_path / f"run-{path.name}", path, SMALL), timeout=END)
        assert res.returncode == 2, res.stderr[-2000:]
        assert f"recstack train: error: {path}: not a prepared data set (no meta.json)" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr


def test_sigkill_during_prepare_leaves_nothing_a_train_accepts(tmp_path: Path) -> None:
    """Killed while writing its ``.tmp`` directory, ``data prepare`` leaves no ``--out`` a train accepts; the
    rerun with --overwrite gives the same files as an uninterrupted prepare."""
    raw = criteo_tsv(tmp_path / "day_0.tsv", 150_000)
    ref, out = tmp_path / "ref", tmp_path / "out"
    done = run_cli(["data", "prepare", str(raw), "--out", str(ref)], timeout=END)
    assert done.returncode == 0, done.stderr[-2000:]
    partial = out.with_name("out.tmp") / "sparse.bin"
    killed = kill_when(["data", "prepare", str(raw), "--out", str(out)],
                       lambda: partial.is_file() and partial.stat().st_size > 0)
    assert killed.returncode == -signal.SIGKILL, "prepare finished before it could be killed"
    assert not out.exists()
    refused_by_train(out, tmp_path)
    again = run_cli(["data", "prepare", str(raw), "--out", str(out), "--overwrite"], timeout=END)
    assert again.returncode == 0, again.stderr[-2000:]
    assert not out.with_name("out.tmp").exists()
    assert snapshot_files(out) == snapshot_files(ref)


def test_sigkill_during_synth_leaves_nothing_a_train_accepts(tmp_path: Path) -> None:
    """The same for ``data synth``: killed mid-way, nothing a train accepts; the rerun equals an uninterrupted
    one file for file."""
    args = ["--rows", "300000", "--seed", "3"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    done = run_cli(["data", "synth", "--out", str(ref), *args], timeout=END)
    assert done.returncode == 0, done.stderr[-2000:]
    partial = out.with_name("out.tmp")
    killed = kill_when(["data", "synth", "--out", str(out), *args],
                       lambda: partial.is_dir() and any(p.stat().st_size > 0 for p in partial.iterdir()))
    assert killed.returncode == -signal.SIGKILL, "synth finished before it could be killed"
    assert not (out / "meta.json").exists()
    refused_by_train(out, tmp_path)
    again = run_cli(["data", "synth", "--out", str(out), *args, "--overwrite"], timeout=END)
    assert again.returncode == 0, again.stderr[-2000:]
    assert not partial.exists()
    assert snapshot_files(out) == snapshot_files(ref)


# Tables of 64 columns and a checkpoint every step: a checkpoint write long enough to be caught mid-way.
WIDE = [*SMALL, "model.embedding_dim=64", "model.bottom_mlp=[32, 64]", "train.max_steps=60",
        "train.checkpoint_every=1", "train.eval_every=0", "train.keep_checkpoints=3"]
METRICS = ("auc", "logloss", "ne", "calibration", "accuracy", "steps", "train_samples")


def test_sigkill_during_a_checkpoint_write_resumes_from_the_last_good_one(tiny_dataset: Path,
                                                                          tmp_path: Path) -> None:
    """Killed while a ``ckpt_<step>.pt.tmp`` exists: every complete checkpoint still loads, --resume continues
    from the newest of them (not the torn one) and ends where an uninterrupted run ends."""
    ref = run_cli(train_args(tmp_path / "ref", tiny_dataset, WIDE), timeout=END)
    assert ref.returncode == 0, ref.stderr[-2000:]
    ckpts = tmp_path / "run" / "checkpoints"

    def writing() -> bool:  # a write under way after two complete checkpoints
        try:
            return count_checkpoints(ckpts) >= 2 and any(p.name.endswith(".tmp") for p in ckpts.iterdir())
        except FileNotFoundError:
            return False

    killed = kill_when(train_args(tmp_path / "run", tiny_dataset, WIDE), writing)
    assert killed.returncode == -signal.SIGKILL, "training finished before a checkpoint write could be caught"
    assert not (tmp_path / "run" / "summary.json").exists()
    good = list_checkpoints(ckpts)
    assert len(good) >= 2 and any(p.name.endswith(".tmp") for p in ckpts.iterdir()), "no write was caught"
    resumed = run_cli(train_args(tmp_path / "run", tiny_dataset, WIDE, "--resume"), timeout=END)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resume: continuing from {good[-1]}" in resumed.stdout, resumed.stdout[-2000:]
    assert "cannot be loaded" not in resumed.stderr
    a = json.loads((tmp_path / "ref" / "summary.json").read_text())
    b = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert {k: a[k] for k in METRICS} == {k: b[k] for k in METRICS}
    assert not any(p.name.endswith(".tmp") for p in ckpts.iterdir())


def test_a_stray_tmp_directory_is_never_taken_as_data(tmp_path: Path) -> None:
    """What a SIGKILL leaves (a ``.tmp`` directory holding part of the arrays) is not data: train refuses the
    final path and the ``.tmp``, and a prepare without --overwrite replaces the stray directory."""
    raw = criteo_tsv(tmp_path / "day_0.tsv", 2000)
    stray = tmp_path / "out.tmp"
    stray.mkdir()
    (stray / "labels.bin").write_bytes(b"\0" * 100)
    refused_by_train(tmp_path / "out", tmp_path)
    res = run_cli(["data", "prepare", str(raw), "--out", str(tmp_path / "out")], timeout=END)
    assert res.returncode == 0, res.stderr[-2000:]
    assert not stray.exists() and (tmp_path / "out" / "meta.json").is_file()


# The tiny set's C4 in an ssd-cached tier: a checkpoint directory with table files and a state.pt.
SSD = [*SMALL, "train.max_steps=4", "train.checkpoint_every=2", "train.eval_every=0",
       'memory.device="16452"', 'memory.host="0"']


@pytest.mark.parametrize(("name", "refusal"), [
    ("state.pt", "refused: it holds objects other than tensors and plain values"),
    ("tables/003.f32", "checksum mismatch"),  # raw float32 rows, never unpickled: the checksum refuses them
])
def test_a_crafted_tiered_checkpoint_file_runs_nothing(tiny_dataset: Path, tmp_path: Path, name: str,
                                                       refusal: str) -> None:
    """A tiered checkpoint's state.pt (a valid torch file) or a table file (padded to its size) replaced by a
    pickle that runs a command: ``recstack eval`` refuses it with one line naming the file, and the command never
    runs."""
    run = tmp_path / "run"
    res = run_cli(train_args(run, tiny_dataset, [*SSD, f'memory.ssd_dir="{tmp_path / "ssd"}"']), timeout=END)
    assert res.returncode == 0, res.stderr[-2000:]
    ckpt = run / "checkpoints" / "ckpt_000000004"
    marker, file = tmp_path / "pwned", ckpt / name
    assert file.is_file()
    if name.endswith(".pt"):
        torch.save({"complete": True, "step": 4, "x": Payload(marker)}, file)
    else:
        size = file.stat().st_size
        file.write_bytes(pickle.dumps(Payload(marker)).ljust(size, b"\0"))
    res = run_cli(["eval", "--checkpoint", str(ckpt)], timeout=END)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert f"recstack eval: error: {file}: {refusal}" in res.stderr, res.stderr[-2000:]
    assert not marker.exists()


def test_the_matrix_names_tests_that_exist() -> None:
    """Every ``module::name`` of the table above is a test function of that module (a renamed or removed test
    fails here, so the matrix stays complete)."""
    named = re.findall(r"^    (\S+\.py)::(test_\w+)$", __doc__ or "", re.MULTILINE)
    assert len(named) > 50
    missing = [f"{module}::{name}" for module, name in named
               if not re.search(rf"^def {name}\(", (TESTS / module).read_text(), re.MULTILINE)]
    assert missing == []
