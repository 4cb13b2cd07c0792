"""The router machine: ``step(state, event) -> (state, effects)``, its state, attempts and events."""
