"""Parity harness: pdkv's KVCacheManager must make exactly vLLM 0.25.1's decisions.

Scenarios are plain JSON-able op lists (`scenarios.py`, `driver.py`). `record_vllm.py` runs them
inside the vLLM anchor venv and writes what vLLM observed to `fixtures/vllm_0_25_1.json`;
`tests/kvcache/test_parity.py` replays the same ops against pdkv and compares op by op.
Block hash values are never compared (the hash functions differ), only decisions: block ids,
hit lengths, None results, errors and free-block counts.
"""
