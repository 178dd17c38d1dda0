"""Serving a trained model: ``export`` writes a versioned artifact (``artifact``: layout, manifest, checksums) of
a checkpoint's dense program, row-wise quantized tables (``quantized``) and feature transforms (``transforms``);
``publish.Publisher`` publishes a training model as full versions and deltas (``delta``); ``model.ServingModel``
loads one (a delta on the version it applies to) and scores raw or encoded rows; ``server`` serves it over HTTP
(dynamic batching in ``batching``, hot swap in ``watch``, Prometheus metrics in ``metrics``). See
docs/serving.md."""
