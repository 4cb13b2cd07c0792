"""``kvrelay bench scenarios``: measured cases on a real local cluster (cases, prompts, statistics, report, plots)."""
