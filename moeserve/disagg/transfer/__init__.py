"""KV transfer between a prefill rank and a decode rank: a control protocol over an authenticated
side channel (``manager.py``) and pluggable data paths (``base.TransferBackend``)."""
