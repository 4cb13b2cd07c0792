"""A Mooncake-format trace replayed end to end through real servers (issue 9): prompts, faces, client, report."""
