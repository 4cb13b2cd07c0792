"""Measured scenarios with a real model, end to end (``kvrelay bench``)."""
