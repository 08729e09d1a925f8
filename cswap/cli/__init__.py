"""Command lines: cswap-train and cswap-tune."""
