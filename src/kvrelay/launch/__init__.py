"""Processes and their wiring: ``serve``, router, worker and cluster processes, child processes, configuration."""
