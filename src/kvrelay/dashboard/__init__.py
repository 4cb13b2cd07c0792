"""The router's live status page: a read-only tap on the router, its JSON, and the page's static files."""
