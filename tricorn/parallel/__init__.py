"""Parallelism, one module per kind; the model never imports from here."""
