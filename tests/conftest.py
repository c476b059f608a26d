"""Shared test configuration.

The pool-leak helper every KV test ends with is `kvcache.audit.assert_all_free`;
tests import it from there so there is exactly one definition.
"""
import logging

logging.getLogger("ray").setLevel(logging.WARNING)
