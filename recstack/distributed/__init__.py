"""Hybrid parallelism: sharded embedding collections (one module per sharding type), all-to-all with
codecs, the planner, and the glue that turns a single-device model into a distributed one."""
