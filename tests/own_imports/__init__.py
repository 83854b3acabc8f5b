"""Modules whose functions a rank is called with, each imported the first time by such a call
(``tests/test_rank_zygote.py``): one that imports nothing but its own package's modules, one that reads
the environment as it is imported, and one that imports a module of another package."""
