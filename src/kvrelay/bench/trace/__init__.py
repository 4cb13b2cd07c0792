"""A Mooncake-format trace replayed end to end through real servers: prompts, faces, client, report."""
