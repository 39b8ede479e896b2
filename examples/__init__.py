"""Examples, not library code: ``kvpool demo`` (:mod:`kvpool.examples.demo`) and the
SmolLM2 loader it, the tests and the benchmarks use (:mod:`kvpool.examples.models`).

Nothing in the library imports this package; it imports the library (the SDK and the
GPU client) like any user would. Needs torch and transformers (``kvpool[hf]``).
"""
