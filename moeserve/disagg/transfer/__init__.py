"""KV transfer between a prefill rank and a decode rank: a control protocol (``protocol.py``) over
an authenticated side channel, run by one loop per rank (``loop.py``) for its side
(``prefill.PrefillTransfer`` or ``decode.DecodeTransfer``), and pluggable data paths
(``base.TransferBackend``)."""
