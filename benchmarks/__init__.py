"""What bench.py measures, one job per file (listed in README.md), built on the machinery and never imported by it:
nothing runs on import."""
