"""Conversion between tricorn checkpoints and other tools' formats (`tricorn import-hf` / `export-hf`)."""
