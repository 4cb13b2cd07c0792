"""WebSocket endpoints for router and workers."""
