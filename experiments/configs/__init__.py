"""Experiment configurations (``ml_collections.ConfigDict``), one module per setting."""
