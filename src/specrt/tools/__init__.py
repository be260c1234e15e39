"""Tools that measure, check and show: benchmarks, the controller's replay, llama.cpp beside
specrt, quality metrics, the doctor and its GPU check, the demo, synthetic checkpoints.

They sit downstream of everything else and nothing but the CLI and other tools import them;
the package root keeps the contracts the rest of specrt depends on.
"""
