"""The explorer service: low-precision, few-step seed search with hot-reloadable adapters."""
