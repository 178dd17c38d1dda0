"""Checkpoints: ``checkpointer.Checkpointer`` saves and loads the components of ``state.py`` as a single file,
a directory with table files (cached tiers) or sharded DCP directories (torchrun); ``resume.py`` claims the run
directory and moves a data position to new batches."""
