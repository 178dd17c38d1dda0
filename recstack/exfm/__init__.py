"""ExFM: one foundation model (FM) teaching several vertical models (VMs) on streaming data.

Modules, one concept each:

* ``config``      the experiment's typed TOML config
* ``windows``     time-ordered windows over a prepared data set; staleness -> snapshot version
* ``stream``      the streaming trainer: evaluate window t, train on it once, checkpoint, resume exactly
* ``fm``          the FM stream and its versioned snapshots
* ``store``       the DAS store (Parquet parts, atomic, exactly once)
* ``das``         the data augmentation service process that fills the store
* ``vm``          the VM with Auxiliary Head and Student Adapter, and its serving export
* ``vm_stream``   a VM's stream joined with the logged FM predictions
* ``experiment``  ``recstack exfm run``: arms x staleness x seeds
* ``movielens``   MovieLens-100k (u.data or RecBole layout) as a real stream
* ``report``      NE gain tables and charts
"""
