"""kvpool benchmarks: programs that print a table and write JSON (not part of pytest)."""
