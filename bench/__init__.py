"""The umt benchmark harness: `python -m bench --help` (or `make bench`)."""
