"""recstack: training and serving large-embedding recommendation models, from one CPU to a GPU cluster."""

__version__ = "0.1.0"
