"""The OpenAI-compatible HTTP gateway: app, request schemas, metrics and backends."""
