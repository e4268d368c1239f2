"""One module per array library; `optimisers._ops.backend` picks one from an array's type."""
