"""What the router plans with: residency index, routes, candidates, roster, registry, predicted TTFT, prefill order."""
