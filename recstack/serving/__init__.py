"""Serving a trained model: ``export`` writes a versioned artifact (``artifact``: layout, manifest, checksums) of
a checkpoint's dense program, row-wise quantized tables (``quantized``) and feature transforms (``transforms``);
``model.ServingModel`` loads one and scores raw or encoded rows; ``server`` serves it over HTTP (dynamic
batching in ``batching``, hot swap in ``watch``, Prometheus metrics in ``metrics``). See docs/serving.md."""
