"""Worker side: page pool, local admission, the device loop and its handlers."""
