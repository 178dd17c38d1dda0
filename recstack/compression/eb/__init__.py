"""The error-bounded lossy codec (``core``: encode/decode; ``codec``: the all-to-all codec; ``bounds``: the
dual-level adaptive bound) and its host loops (``host``, ``native``, ``packing``, ``quantize``)."""
