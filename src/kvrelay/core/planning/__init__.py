"""What the router plans with: the residency index, routes, candidates, roster, worker registry, predicted TTFT and prefill order."""
