"""Prefill/decode disaggregation: the PD roles, the bootstrap server, and KV transfer backends."""
