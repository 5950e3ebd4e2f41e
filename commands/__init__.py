"""The user commands behind `onegraph eval`, `bench` and `bench-serve` (cli.py parses and dispatches)."""
