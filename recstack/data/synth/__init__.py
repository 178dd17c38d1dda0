"""Synthetic click logs with known optima: the generator (``generate``), its click model and id samplers."""
