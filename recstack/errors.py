"""One exception family. Every error that a user's input can cause (a config, a data file, a checkpoint, a plan,
a message) is a :class:`RecstackError`; the command line prints its message and exits with its ``exit_code``
instead of a traceback. Each class also derives from the builtin a caller would expect (``ValueError`` for bad
input), so ``except ValueError`` keeps working."""

from __future__ import annotations


class RecstackError(Exception):
    """Base of every error recstack raises on purpose. ``exit_code``: what ``recstack`` exits with."""

    exit_code = 2


class ConfigError(RecstackError, ValueError):
    """A config file or override names an unknown key, gives a value of the wrong type or out of range."""


class CheckpointError(RecstackError, ValueError, RuntimeError):
    """A checkpoint is unreadable, incomplete or does not fit the model: a table missing or of another size,
    saved pieces that do not cover it, a file a rank cannot read. (A ``RuntimeError`` too, as single-process
    checkpoint errors always were.)"""


class PeerFailure(RecstackError, RuntimeError):
    """Another rank died or stopped answering; this rank gives up instead of hanging."""

    exit_code = 3


class DivergenceError(RecstackError, FloatingPointError):
    """Training diverged: a non-finite loss or weight, or a loss far above its running level
    (``train.divergence_factor``). The run stops before it writes a checkpoint of the diverged values."""


class DiskError(RecstackError, OSError):
    """Writing a file failed on the disk's side: a read-only directory, no permission, no space left, a file
    where a directory should be. The message names the path and the cause; what was half-written is removed
    (``recstack.io.writing``)."""


class ServiceFailure(RecstackError, RuntimeError):
    """A helper process recstack started and depends on (the ExFM data augmentation service) died."""

    exit_code = 3


class TuneError(RecstackError, RuntimeError):
    """A tuning study cannot go on: its first trial failed (the recipe, the data or the space is wrong for this
    data), or its trials keep failing. The message names the trial and its log."""


class StreamError(RecstackError, ValueError):
    """A training stream cannot be followed: its directory is missing or not a directory, or a partition cannot
    be read in the stream's format (the message names the directory or the file)."""
