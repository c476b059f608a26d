"""The data paths: one interface (`base.py`: `PathServer`, `PathReceiver`), one module per path
(`tcp.py`, `shm_mapped.py`, `shm_staged.py`, `cuda_ipc.py`), chosen once per session and stream
(`choice.py`); how a stream reaches its pool's pages (`page_access.py` in place, `staging_ring.py`
through the pinned staging ring). Imports only `control/` of the other rooms."""
