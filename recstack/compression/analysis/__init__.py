"""Payload capture (``recstack train --dump-a2a``), analysis (``recstack analyze-a2a``) and baselines."""
