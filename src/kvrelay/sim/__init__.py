"""The simulator: the router and worker machines under logical time, simulated workers and network, traces,
cluster configs and calibration."""
