"""The benchmark harness shared by the ``bench/`` scripts and ``kvrelay bench``."""
