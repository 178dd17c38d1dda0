"""Training data that arrives while a run trains: a ``StreamSource`` yields partitions in order (``source.py``:
the interface and ``DirectoryStream``, a directory of files each read once in name order), and a
``PartitionReader`` turns each into rows in memory (``partition.py``: raw Criteo TSV, the schema formats)."""

from recstack.data.stream.partition import PartitionReader, PartitionRows, StreamLayout, partition_reader
from recstack.data.stream.source import DirectoryStream, Partition, StreamPosition, StreamSource

__all__ = ["DirectoryStream", "Partition", "PartitionReader", "PartitionRows", "StreamLayout", "StreamPosition",
           "StreamSource", "partition_reader"]
