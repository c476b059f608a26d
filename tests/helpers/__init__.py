"""Helpers shared by test modules in several folders, imported as `tests.helpers.<module>`.

The repository root is on `sys.path` (pytest's `pythonpath` option in pyproject.toml), so no test edits
`sys.path`. A helper used by one folder only stays beside its tests (pytest puts a test's own folder on
`sys.path`); one used by two folders, or run as a peer process (`python -m tests.helpers.peer_proc`),
lives here.
"""
