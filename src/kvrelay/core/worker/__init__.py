"""The worker protocol machine: offers, admission, fencing and results as pure transitions."""
