"""Router, worker protocol machine, candidates and registry (pure); sim and cluster interpreters."""
