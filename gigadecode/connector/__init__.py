"""KV transfer for disaggregated inference: the connector interface (`base`) and the NIXL agent (`nixl_agent`)."""
