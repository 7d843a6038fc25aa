"""The regenerator service: BF16, full-step re-sampling of kept seeds with hot-reloadable adapters."""
