"""Request traces over OpenTelemetry: the exporter (``tracing``) and the spans the router's and the worker's
shells start and end from what their pure machines emit (``router_spans``, ``worker_spans``)."""
