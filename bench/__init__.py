"""Load benchmarks of the receiver on loopback: ``python -m bench`` (see bench/README.md)."""
